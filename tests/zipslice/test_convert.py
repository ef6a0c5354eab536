"""convert and diff: real files from torch.save / safetensors, results checked against torch and safetensors."""
import json
import math
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zipslice import dtypes
from zipslice.convert import LAYOUT_KEY, cast_bytes, convert
from zipslice.diff import diff
from zipslice.errors import UnsupportedCheckpointError, ZipsliceError


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _checkpoint():
    """A typical training checkpoint: nested modules, tied embedding, plain values."""
    emb = torch.nn.Parameter(torch.randn(16, 8))
    model = OrderedDict([("embed.weight", emb), ("proj.weight", torch.nn.Parameter(torch.randn(8, 8))),
                         ("proj.bias", torch.randn(8, dtype=torch.float64)), ("steps", torch.arange(5)),
                         ("half", torch.randn(4).to(torch.bfloat16)), ("head.weight", emb)])
    model._metadata = OrderedDict([("", {"version": 1})])
    return {"model": model, "epoch": 3, "lr": 0.5, "tags": ["a", ("b", None)]}


def _same_checkpoint(got, want):
    assert type(got["model"]) is OrderedDict and list(got["model"]) == list(want["model"])
    assert got["model"]._metadata == want["model"]._metadata
    for k, w in want["model"].items():
        g = got["model"][k]
        assert g.dtype == w.dtype and g.shape == w.shape and _bits(g) == _bits(w), k
        assert type(g) is type(w), k
    assert {k: v for k, v in got.items() if k != "model"} == {k: v for k, v in want.items() if k != "model"}


def test_torch_to_safetensors_and_back_keeps_everything(tmp_path):
    ck = _checkpoint()
    torch.save(ck, tmp_path / "m.pt")
    r = convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert (r.format, r.tensors, r.cast) == ("safetensors", 6, 0)
    flat = load_file(tmp_path / "m.safetensors")  # safetensors' own loader reads every name
    assert set(flat) == {f"model/{k}" for k in ck["model"]}
    for k, w in ck["model"].items():
        assert _bits(flat[f"model/{k}"]) == _bits(w), k
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        layout = json.loads(f.metadata()[LAYOUT_KEY])
    assert layout["ties"] == [["model/embed.weight", "model/head.weight"]]

    convert(tmp_path / "m.safetensors", tmp_path / "back.pt")
    for kw in (dict(weights_only=True), dict(weights_only=True, mmap=True)):
        got = torch.load(tmp_path / "back.pt", **kw)
        _same_checkpoint(got, ck)
        m = got["model"]
        assert m["head.weight"].untyped_storage().data_ptr() == m["embed.weight"].untyped_storage().data_ptr()


def test_torch_to_torch_is_faithful(tmp_path):
    ck = _checkpoint()
    torch.save(ck, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "copy.pt")
    _same_checkpoint(torch.load(tmp_path / "copy.pt", weights_only=True), ck)
    assert diff(tmp_path / "m.pt", tmp_path / "copy.pt").identical


def test_no_layout_writes_a_flat_dict(tmp_path):
    torch.save(_checkpoint(), tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors", keep_layout=False)
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert LAYOUT_KEY not in (f.metadata() or {})
    convert(tmp_path / "m.safetensors", tmp_path / "flat.pt")
    got = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert sorted(got) == sorted(f"model/{k}" for k in _checkpoint()["model"])


def test_edited_tie_is_not_retied(tmp_path):
    a, b = torch.ones(3), torch.full((3,), 2.0)
    layout = {"version": 1, "structure": None, "ties": [["a", "b"]], "parameters": [], "requires_grad": []}
    save_file({"a": a, "b": b}, tmp_path / "e.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    convert(tmp_path / "e.safetensors", tmp_path / "e.pt")
    got = torch.load(tmp_path / "e.pt", weights_only=True)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert got["a"].untyped_storage().data_ptr() != got["b"].untyped_storage().data_ptr()


def test_layout_that_does_not_match_is_refused(tmp_path):
    layout = {"version": 1, "structure": {"dict": [["x", {"tensor": "x"}]]}, "ties": [], "parameters": [],
              "requires_grad": []}
    save_file({"y": torch.ones(1)}, tmp_path / "bad.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    with pytest.raises(ZipsliceError, match="does not match the tensors"):
        convert(tmp_path / "bad.safetensors", tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
    convert(tmp_path / "bad.safetensors", tmp_path / "ok.pt", keep_layout=False)
    assert torch.equal(torch.load(tmp_path / "ok.pt", weights_only=True)["y"], torch.ones(1))


def _assert_like_torch(got: np.ndarray, want: torch.Tensor, dtype: str):
    """Bits equal torch's everywhere except NaN payloads; NaN stays NaN."""
    carrier = dtypes.get(dtype).carrier
    g = got.view(carrier)
    w = want.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[carrier.itemsize]).numpy().view(carrier)
    g_nan = np.isnan(got.view(dtypes.get(dtype).to_numpy()).astype(np.float32))
    w_nan = torch.isnan(want.float()).numpy()
    assert np.array_equal(g_nan, w_nan)
    assert np.array_equal(g[~g_nan], w[~w_nan])


@pytest.mark.parametrize("src", [d for d in dtypes.BY_NAME if dtypes.get(d).kind == "float"])
@pytest.mark.parametrize("dst", ["bfloat16", "float16", "float32"])
def test_cast_equals_torch_to(src, dst):
    n = 20_000
    size = dtypes.get(src).itemsize
    raw = np.random.default_rng(hash((src, dst)) % 2 ** 32).integers(0, 256, n * size, dtype=np.uint8)
    t = torch.from_numpy(raw.copy()).view(getattr(torch, src))
    got = cast_bytes(raw.tobytes(), src, dst)
    _assert_like_torch(got, t.to(getattr(torch, dst)), dst)


def test_float64_rounds_through_float32_like_torch():
    x = np.array([1 + 2 ** -11 + 2 ** -40], dtype="<f8")  # direct rounding to half would give 1.000977
    assert cast_bytes(x.tobytes(), "float64", "float16").view(np.float16)[0] == 1.0
    assert torch.tensor(x).to(torch.float16).item() == 1.0


def test_convert_with_dtype_casts_floats_only(tmp_path):
    ck = _checkpoint()
    torch.save(ck, tmp_path / "m.pt")
    r = convert(tmp_path / "m.pt", tmp_path / "h.safetensors", dtype="float16")
    assert r.cast == 5  # every floating tensor (tied ones counted per name); the int64 one is untouched
    got = load_file(tmp_path / "h.safetensors")
    for k, w in ck["model"].items():
        g = got[f"model/{k}"]
        if w.is_floating_point():
            assert g.dtype == torch.float16 and torch.equal(g, w.detach().to(torch.float16)), k
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), k
    convert(tmp_path / "m.pt", tmp_path / "b.pt", dtype="bfloat16")
    m = torch.load(tmp_path / "b.pt", weights_only=True)["model"]
    assert m["embed.weight"].dtype == torch.bfloat16 and isinstance(m["embed.weight"], torch.nn.Parameter)
    assert m["head.weight"].untyped_storage().data_ptr() == m["embed.weight"].untyped_storage().data_ptr()


def test_progress_reports_every_byte(tmp_path):
    torch.save(_checkpoint(), tmp_path / "m.pt")
    seen = []
    r = convert(tmp_path / "m.pt", tmp_path / "p.pt", progress=lambda n, total: seen.append((n, total)))
    assert sum(n for n, _ in seen) == r.nbytes == seen[0][1]
    assert r.nbytes == 16 * 8 * 4 + 8 * 8 * 4 + 8 * 8 + 5 * 8 + 4 * 2  # the tied tensor once


def test_unrepresentable_dtype_is_a_clear_error(tmp_path):
    torch.save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.pt")
    with pytest.raises(UnsupportedCheckpointError, match="complex128"):
        convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    assert not (tmp_path / "c.safetensors").exists()


def test_bad_arguments(tmp_path):
    torch.save({"x": torch.ones(1)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="cannot cast"):
        convert(tmp_path / "x.pt", tmp_path / "y.pt", dtype="int8")
    with pytest.raises(ValueError, match="cannot tell the output format"):
        convert(tmp_path / "x.pt", tmp_path / "y.weird")
    with pytest.raises(ZipsliceError, match="same file"):
        convert(tmp_path / "x.pt", tmp_path / "x.pt")


def test_hdf5_round_trip(tmp_path):
    pytest.importorskip("zipslice.hdf5_format")
    ck = _checkpoint()
    torch.save(ck, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "m.h5")
    import h5py

    with h5py.File(tmp_path / "m.h5", "r") as f:
        group = f["model"]
        assert sorted(group) == sorted(ck["model"])  # every name is there; the tie is a hard link
        assert group["head.weight"].id == group["embed.weight"].id
        assert json.loads(f.attrs[LAYOUT_KEY])["ties"] == [["model/embed.weight", "model/head.weight"]]
    convert(tmp_path / "m.h5", tmp_path / "back.pt")
    _same_checkpoint(torch.load(tmp_path / "back.pt", weights_only=True), ck)


# -- diff ------------------------------------------------------------------------------------------

def test_diff_reports_each_kind_of_change(tmp_path):
    a = {"w": torch.randn(1000), "i": torch.tensor([2 ** 62, -(2 ** 62), 5]), "gone": torch.ones(1),
         "c": torch.zeros(2, dtype=torch.complex64), "bf": torch.ones(3, dtype=torch.bfloat16), "s": torch.ones(2, 2),
         "same": torch.arange(7)}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][3] += 1.5
    b["w"][7] = float("nan")
    b["i"][1] = 2 ** 62
    del b["gone"]
    b["new"] = torch.ones(2)
    b["c"][1] = 3 + 4j
    b["bf"] = torch.tensor([1.0, 2.0, 1.0])
    b["s"] = torch.ones(4)
    torch.save({"m": a, "step": 1}, tmp_path / "a.pt")
    save_file({f"m/{k}": v.contiguous() for k, v in b.items() if k != "c"}, tmp_path / "b.safetensors")
    torch.save({"m": b, "step": 2}, tmp_path / "b.pt")
    rep = {t.name: t for t in diff(tmp_path / "a.pt", tmp_path / "b.pt").tensors}
    assert rep["m/w"].status == "changed" and rep["m/w"].n_changed == 2 and math.isnan(rep["m/w"].max_abs_diff)
    assert rep["m/i"].n_changed == 1 and rep["m/i"].max_abs_diff == 2 ** 63  # exact, beyond float64
    assert rep["m/gone"].status == "removed" and rep["m/new"].status == "added"
    assert rep["m/c"].n_changed == 1 and rep["m/c"].max_abs_diff == 5.0
    assert rep["m/bf"].dtype == ("bfloat16", "float32") and rep["m/bf"].n_changed == 1
    assert rep["m/bf"].max_abs_diff == 1.0
    assert rep["m/s"].status == "changed" and rep["m/s"].n_changed is None
    assert rep["m/same"].status == "same" and rep["m/same"].max_abs_diff == 0
    full = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert [(e.name, e.status, e.a, e.b) for e in full.extras] == [("step", "changed", 1, 2)]
    assert json.loads(json.dumps(full.to_json()))["counts"] == {"added": 1, "removed": 1, "changed": 5, "same": 1}
    # across formats: same values, different files
    cross = diff(tmp_path / "b.pt", tmp_path / "b.safetensors")
    assert {t.name: t.status for t in cross.tensors if t.status != "same"} == {"m/c": "removed"}


def test_diff_reads_in_chunks(tmp_path, monkeypatch):
    import zipslice.diff as zd

    monkeypatch.setattr(zd, "CHUNK_ELEMENTS", 7)
    x = torch.randn(100)
    y = x.clone()
    y[[0, 50, 99]] += torch.tensor([1.0, -4.0, 2.0])
    torch.save({"x": x}, tmp_path / "a.pt")
    save_file({"x": y}, tmp_path / "b.safetensors")
    chunks = list(zd.iter_chunks(__import__("zipslice").load(tmp_path / "a.pt"), "x", 7))
    assert len(chunks) == 15 and np.array_equal(np.concatenate(chunks).view("<f4"), x.numpy())
    t = zd.diff(tmp_path / "a.pt", tmp_path / "b.safetensors").tensors[0]
    assert t.n_changed == 3 and t.max_abs_diff == pytest.approx(4.0)


# -- memory ----------------------------------------------------------------------------------------

_PEAK = textwrap.dedent("""
    import resource, sys
    from zipslice.convert import convert
    convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else None)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")
_BASELINE = "import resource, zipslice.convert; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"


def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """16 tensors of 16 MiB (256 MiB): converting must stay near 2 x 16 MiB above the interpreter."""
    torch.save({f"t{i}": torch.randn(4 << 20) for i in range(16)}, tmp_path / "big.pt")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    base = int(subprocess.check_output([sys.executable, "-c", _BASELINE], env=env))
    for dst, extra in (("big.safetensors", []), ("big2.pt", ["bfloat16"])):
        peak = int(subprocess.check_output([sys.executable, "-c", _PEAK, str(tmp_path / "big.pt"),
                                            str(tmp_path / dst), *extra], env=env))
        assert peak - base < 2 * (16 << 20) + (100 << 20), (dst, (peak - base) >> 20)


def test_direct_read_names_a_truncated_file(tmp_path):
    import zipslice
    from zipslice.convert import direct_read

    torch.save({"x": torch.arange(1000.0)}, tmp_path / "t.pt")
    with zipslice.load(tmp_path / "t.pt") as lsd:
        info = lsd.info("x")
        read = direct_read(info)
        assert np.array_equal(read().view("<f4"), np.arange(1000.0, dtype="<f4"))
        os.truncate(tmp_path / "t.pt", info.offset + 100)
        with pytest.raises(ZipsliceError, match=r"t\.pt \[x\].*truncated"):
            read()


def test_diff_progress_covers_common_tensors(tmp_path):
    torch.save({"a": torch.ones(10), "b": torch.ones(3, dtype=torch.int16)}, tmp_path / "x.pt")
    torch.save({"a": torch.zeros(10), "c": torch.ones(1)}, tmp_path / "y.pt")
    seen = []
    diff(tmp_path / "x.pt", tmp_path / "y.pt", progress=lambda n, total: seen.append((n, total)))
    assert seen == [(40, 40)]


# -- round trips add nothing the source did not need -------------------------------------------------

def _header(path) -> bytes:
    raw = open(path, "rb").read()
    return raw[8:8 + int.from_bytes(raw[:8], "little")]


def test_flat_dict_round_trip_adds_no_metadata(tmp_path):
    """safetensors -> torch -> safetensors gives the same file; a flat dict needs no layout entry anywhere."""
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(4, 4, generator=g) for i in (0, 1, 2, 10, 11)}
    sd["embed"] = torch.randn(3, generator=g).to(torch.bfloat16)
    save_file(sd, tmp_path / "a.safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "a.pt")
    assert isinstance(torch.load(tmp_path / "a.pt", weights_only=True), dict)
    convert(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert _header(tmp_path / "b.safetensors") == _header(tmp_path / "a.safetensors")
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    # torch -> h5 -> torch: no attribute added, the same dict back in the same order
    import h5py

    convert(tmp_path / "a.pt", tmp_path / "a.h5")
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert dict(f.attrs) == {}
    convert(tmp_path / "a.h5", tmp_path / "c.pt")
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    want = torch.load(tmp_path / "a.pt", weights_only=True)
    assert list(got) == list(want) and all(_bits(got[k]) == _bits(want[k]) for k in want)


def test_torch_order_that_safetensors_cannot_keep_is_kept_in_the_layout(tmp_path):
    """A flat torch dict in an order safetensors would not read back still round-trips in its order."""
    sd = OrderedDict([("z", torch.ones(2)), ("a", torch.zeros(2))])
    torch.save(dict(sd), tmp_path / "o.pt")
    convert(tmp_path / "o.pt", tmp_path / "o.safetensors")
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        assert LAYOUT_KEY in f.metadata()
    convert(tmp_path / "o.safetensors", tmp_path / "o2.pt")
    assert list(torch.load(tmp_path / "o2.pt", weights_only=True)) == ["z", "a"]


def test_nested_layout_is_compact_and_reads_back(tmp_path):
    sd = {"model": OrderedDict((f"layer.{i}.weight", torch.full((2,), float(i))) for i in range(40)), "epoch": 3}
    torch.save(sd, tmp_path / "n.pt")
    convert(tmp_path / "n.pt", tmp_path / "n.safetensors")
    with safe_open(tmp_path / "n.safetensors", "pt") as f:
        text = f.metadata()[LAYOUT_KEY]
    layout = json.loads(text)
    assert layout["version"] == 2 and set(layout) == {"version", "structure"}  # nothing else to say
    leaves = layout["structure"]["dict"][0][1]["odict"]
    assert all(node is None for _, node in leaves)  # each tensor named by its own path: null
    assert len(text) < 40 * len('["layer.10.weight",null],') + 200
    convert(tmp_path / "n.safetensors", tmp_path / "n2.pt")
    got = torch.load(tmp_path / "n2.pt", weights_only=True)
    assert got["epoch"] == 3 and type(got["model"]) is OrderedDict and list(got["model"]) == list(sd["model"])
    assert all(torch.equal(got["model"][k], v) for k, v in sd["model"].items())


def test_version_1_layouts_still_read(tmp_path):
    layout = {"version": 1, "structure": {"dict": [["m", {"dict": [["w", {"tensor": "m/w"}]]}]]}, "ties": [],
              "parameters": ["m/w"], "requires_grad": ["m/w"]}
    save_file({"m/w": torch.ones(2)}, tmp_path / "v1.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    convert(tmp_path / "v1.safetensors", tmp_path / "v1.pt")
    got = torch.load(tmp_path / "v1.pt", weights_only=True)
    assert isinstance(got["m"]["w"], torch.nn.Parameter) and got["m"]["w"].requires_grad


def test_nested_checkpoint_round_trips_through_shards(tmp_path):
    """The layout of a sharded output lives in its index (a shard alone stays a plain flat file)."""
    ck = _checkpoint()
    torch.save(ck, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "s.safetensors.index.json", max_shard_bytes=600)
    index = json.loads((tmp_path / "s.safetensors.index.json").read_text())
    assert LAYOUT_KEY in index["metadata"] and index["metadata"]["total_size"] > 0
    shards = sorted(tmp_path.glob("s-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert LAYOUT_KEY not in (f.metadata() or {})
        convert(shard, tmp_path / "one.pt")  # a single shard converts on its own
    convert(tmp_path / "s.safetensors.index.json", tmp_path / "back.pt")
    got = torch.load(tmp_path / "back.pt", weights_only=True)
    _same_checkpoint(got, ck)
