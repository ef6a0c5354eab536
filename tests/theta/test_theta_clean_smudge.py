"""clean_checkpoint -> metadata -> smudge_checkpoint, on files written by torch, safetensors and h5py.

No git needed: the store is a plain directory in git-lfs's layout.
"""
import os
from collections import OrderedDict

import h5py
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from theta.storage import metadata
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.base.errors import BlobMissingError, CheckpointError
from theta.model.smudge import smudge_checkpoint
from theta.storage.store import LfsStore


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "lfs" / "objects")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t):
        t = t.detach().contiguous().reshape(-1)
        return t if t.dtype == torch.bool else t.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def nested_checkpoint():
    torch.manual_seed(0)
    enc = torch.nn.Linear(8, 6)
    emb = torch.nn.Parameter(torch.randn(10, 8))
    sd = OrderedDict([("enc.weight", enc.weight), ("enc.bias", enc.bias), ("emb", emb),
                      ("head", emb)])  # tied: same Parameter under two names
    sd._metadata = {"": {"version": 1}}
    return {
        "model": sd,
        "buffers": {"bf": torch.randn(3, 5).bfloat16(), "h": torch.randn(4).half(), "mask": torch.tensor([True, False]),
                    "count": torch.tensor(7, dtype=torch.int64), "empty": torch.empty(0, 3),
                    "f8": torch.randn(6).to(torch.float8_e4m3fn), "c": torch.randn(2, dtype=torch.complex64)},
        "step": 1234, "lr": 3e-4, "name": "run-1", "betas": (0.9, 0.999), "flags": [True, None, "x"],
    }


def assert_same_nested(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_nested(a[k], b[k])
        if hasattr(a, "_metadata"):
            assert a._metadata == b._metadata
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_nested(x, y)
    elif isinstance(a, torch.Tensor):
        assert same_bits(a, b)
        assert a.requires_grad == b.requires_grad
    else:
        assert a == b


def test_torch_nested_tied_params_and_leaves_bit_for_bit(tmp_path, store):
    obj = nested_checkpoint()
    src = tmp_path / "m.pt"
    torch.save(obj, src)
    stats = CleanStats()
    meta = clean_checkpoint(src, store, None, CleanOptions(), stats=stats)
    assert stats.aliases == 1 and meta.aliases["model/head"].of == "model/emb"
    assert stats.groups == len(meta.groups) == 10
    text = metadata.dumps(meta)
    out = tmp_path / "out.pt"
    smudge_checkpoint(metadata.loads(text), store, out)
    back = torch.load(out, weights_only=True)
    assert_same_nested(obj, back)
    m = back["model"]
    assert isinstance(m["emb"], torch.nn.Parameter) and isinstance(m["enc.bias"], torch.nn.Parameter)
    assert m["emb"].untyped_storage().data_ptr() == m["head"].untyped_storage().data_ptr()  # rebuilt tied
    # cleaning the rebuilt file gives the same metadata text (git status stays clean after checkout)
    assert metadata.dumps(clean_checkpoint(out, store, metadata.loads(text))) == text


def test_views_with_gaps_come_back_as_separate_tensors(tmp_path, store):
    base = torch.arange(20, dtype=torch.float32)
    obj = {"full": base, "every_other": base[::2], "slice": base[5:9]}
    torch.save(obj, tmp_path / "v.pt")
    meta = clean_checkpoint(tmp_path / "v.pt", store, None)
    assert not meta.aliases and len(meta.groups) == 3
    smudge_checkpoint(meta, store, tmp_path / "o.pt")
    back = torch.load(tmp_path / "o.pt", weights_only=True)
    for k in obj:
        assert torch.equal(back[k], obj[k])
    assert back["slice"].untyped_storage().data_ptr() != back["full"].untyped_storage().data_ptr()


def test_safetensors_round_trip_with_metadata(tmp_path, store):
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16(), "i": torch.arange(9, dtype=torch.int32),
               "u": torch.tensor([1, 2], dtype=torch.uint8)}
    src = tmp_path / "m.safetensors"
    safetensors.torch.save_file(tensors, src, metadata={"format": "pt", "note": "x"})
    meta = clean_checkpoint(src, store, None)
    assert meta.format == "safetensors" and meta.metadata == {"format": "pt", "note": "x"}
    out = tmp_path / "o.safetensors"
    smudge_checkpoint(metadata.loads(metadata.dumps(meta)), store, out)
    back = safetensors.torch.load_file(out)
    for k, v in tensors.items():
        assert same_bits(v, back[k])
    from safetensors import safe_open
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}


def test_hdf5_round_trip(tmp_path, store):
    src = tmp_path / "m.h5"
    rng = np.random.default_rng(0)
    arrays = {"dense/kernel": rng.standard_normal((16, 4)).astype(np.float32),
              "dense/bias": np.arange(4, dtype=np.float64), "ids": np.arange(5, dtype=np.int16)}
    with h5py.File(src, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    meta = clean_checkpoint(src, store, None)
    assert meta.format == "hdf5" and set(meta.groups) == set(arrays)
    out = tmp_path / "o.h5"
    smudge_checkpoint(meta, store, out)
    with h5py.File(out, "r") as f:
        for k, v in arrays.items():
            got = f[k][()]
            assert got.dtype == v.dtype and got.tobytes() == v.tobytes()


@pytest.mark.parametrize("fmt,ext", [("safetensors", ".safetensors"), ("hdf5", ".h5"), ("torch", ".pt")])
def test_cross_format_smudge(tmp_path, store, fmt, ext):
    tensors = {"a/w": torch.randn(5, 3), "a/b": torch.randn(3).bfloat16(), "n": torch.arange(4)}
    src = tmp_path / "src.pt"
    torch.save(tensors, src)
    meta = clean_checkpoint(src, store, None)
    out = tmp_path / f"out{ext}"
    smudge_checkpoint(meta, store, out, fmt=fmt)
    if fmt == "safetensors":
        back = safetensors.torch.load_file(out)
    elif fmt == "torch":
        back = torch.load(out, weights_only=True)
    else:
        import zipslice
        with zipslice.load(out) as lsd:
            back = {k: lsd[k] for k in lsd}
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert same_bits(v, back[k])


def test_unchanged_groups_write_no_blob_and_reuse_steps(tmp_path, store):
    torch.manual_seed(1)
    sd = {f"l{i}": torch.randn(128, 64) for i in range(6)}
    p = tmp_path / "m.safetensors"
    safetensors.torch.save_file(sd, p)
    first = clean_checkpoint(p, store, None)
    n_objects = store.written_objects
    assert n_objects == 6
    # same content again: nothing written
    again = clean_checkpoint(p, store, first)
    assert metadata.dumps(again) == metadata.dumps(first) and store.written_objects == n_objects
    # change one group: exactly one new blob, the other lines identical
    sd["l3"] = sd["l3"] + 1.0
    safetensors.torch.save_file(sd, p)
    stats = CleanStats()
    second = clean_checkpoint(p, store, first, stats=stats)
    assert store.written_objects == n_objects + 1 and stats.unchanged == 5 and stats.written == 1
    for k in sd:
        assert (second.groups[k].steps == first.groups[k].steps) == (k != "l3")
    diff = set(metadata.dumps(second).splitlines()) ^ set(metadata.dumps(first).splitlines())
    assert len(diff) == 2 and all('"group":"l3"' in l for l in diff)


def test_identical_group_in_another_file_is_stored_once(tmp_path, store):
    w = torch.randn(100, 100)
    safetensors.torch.save_file({"w": w, "x": torch.ones(3)}, tmp_path / "a.safetensors")
    torch.save({"enc": {"w": w.clone()}}, tmp_path / "b.pt")
    a = clean_checkpoint(tmp_path / "a.safetensors", store, None)
    before = store.written_objects
    b = clean_checkpoint(tmp_path / "b.pt", store, None)
    assert store.written_objects == before  # w's blob already there
    assert b.groups["enc/w"].steps[0].blob == a.groups["w"].steps[0].blob


def test_clean_twice_is_deterministic(tmp_path, store):
    torch.save(nested_checkpoint(), tmp_path / "m.pt")
    t1 = metadata.dumps(clean_checkpoint(tmp_path / "m.pt", store, None))
    t2 = metadata.dumps(clean_checkpoint(tmp_path / "m.pt", LfsStore(tmp_path / "other"), None))
    assert t1 == t2


def test_corrupt_and_unsafe_checkpoints_raise_checkpoint_error(tmp_path, store):
    torch.save({"w": torch.randn(1000)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="trunc.pt"):
        clean_checkpoint(tmp_path / "trunc.pt", store, None)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    torch.save({"w": torch.ones(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt"):
        clean_checkpoint(tmp_path / "evil.pt", store, None)
    (tmp_path / "ptr.pt").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 1\n")
    with pytest.raises(CheckpointError, match="LFS pointer"):
        clean_checkpoint(tmp_path / "ptr.pt", store, None)
    with pytest.raises(CheckpointError, match="missing.pt"):
        clean_checkpoint(tmp_path / "missing.pt", store, None)
    assert store.written_objects == 0


def test_smudge_with_missing_blob_names_group_file_oid(tmp_path, store):
    safetensors.torch.save_file({"a": torch.randn(10), "b": torch.randn(20)}, tmp_path / "m.safetensors")
    meta = clean_checkpoint(tmp_path / "m.safetensors", store, None)
    ref = meta.groups["b"].steps[0].blob
    store.path(ref).unlink()
    out = tmp_path / "out.safetensors"
    with pytest.raises(BlobMissingError, match=rf"{ref.oid}.*") as e:
        smudge_checkpoint(meta, store, out)
    assert e.value.group == "b" and e.value.file == "out.safetensors" and e.value.oid == ref.oid
    assert not out.exists()  # nothing half-written


def test_smudge_refuses_a_value_that_does_not_match_its_hash(tmp_path, store):
    safetensors.torch.save_file({"a": torch.randn(50), "b": torch.randn(20)}, tmp_path / "m.safetensors")
    meta = clean_checkpoint(tmp_path / "m.safetensors", store, None)
    meta.groups["a"].hash = "0" * 64  # as if the blob decoded to other values
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous content")
    from theta.base.errors import BlobCorruptError
    with pytest.raises(BlobCorruptError, match="'a'.*content hash"):
        smudge_checkpoint(meta, store, out)
    assert out.read_bytes() == b"previous content"  # untouched
    assert [p.name for p in tmp_path.iterdir() if "theta" in p.name] == []  # no temp file left


def test_unchanged_groups_cost_a_hash_only(tmp_path, store, monkeypatch):
    from theta.base import lsh
    p = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"a": torch.randn(100, 10), "b": torch.randn(30)}, p)
    first = clean_checkpoint(p, store, None)
    calls = []
    real = lsh.signature
    monkeypatch.setattr(lsh, "signature", lambda v: calls.append(v.shape) or real(v))
    import theta.model.clean
    for rebuild in ("reconstruct_proven", "decode_proven_dense"):
        monkeypatch.setattr(theta.model.clean, rebuild, lambda *a, **k: pytest.fail("previous value was rebuilt"))
    again = clean_checkpoint(p, store, first)
    assert calls == [] and metadata.dumps(again) == metadata.dumps(first)


def test_checkpoint_without_tensors(tmp_path, store):
    torch.save({"epoch": 3, "cfg": {"lr": 0.5, "name": "x"}}, tmp_path / "e.pt")
    meta = clean_checkpoint(tmp_path / "e.pt", store, None)
    assert meta.groups == {} and meta.order == [] and meta.blob_refs() == []
    smudge_checkpoint(metadata.loads(metadata.dumps(meta)), store, tmp_path / "o.pt")
    assert torch.load(tmp_path / "o.pt", weights_only=True) == {"epoch": 3, "cfg": {"lr": 0.5, "name": "x"}}


def test_nan_groups_compare_exactly(tmp_path, store):
    w = torch.randn(64, 64)
    w[0, 0] = float("nan")
    p = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w": w}, p)
    first = clean_checkpoint(p, store, None)
    assert first.groups["w"].lsh is None
    safetensors.torch.save_file({"w": w * (1 + 1e-7)}, p)  # noise, NaN where it was
    stats = CleanStats()
    clean_checkpoint(p, store, first, stats=stats)
    assert stats.close == 1
    w2 = w.clone()
    w2[5, 5] += 1.0
    safetensors.torch.save_file({"w": w2}, p)
    stats = CleanStats()
    clean_checkpoint(p, store, first, stats=stats)
    assert stats.written == 1


@pytest.mark.parametrize("where", [0.5, -0.02])
def test_smudge_of_a_corrupt_blob_raises_codec_error(tmp_path, store, where):
    from theta.base.errors import ThetaError
    safetensors.torch.save_file({"w": torch.randn(256, 256)}, tmp_path / "m.safetensors")
    meta = clean_checkpoint(tmp_path / "m.safetensors", store, None)
    path = store.path(meta.groups["w"].steps[0].blob)
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A  # same size: only the content checks can notice
    path.write_bytes(bytes(data))
    with pytest.raises(ThetaError, match="corrupt|does not match|payload|frames"):
        smudge_checkpoint(meta, store, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32,
                torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def test_property_random_checkpoints_round_trip(tmp_path):
    from hypothesis import given, settings, strategies as st

    tensor = st.tuples(st.sampled_from(TORCH_DTYPES), st.lists(st.integers(0, 5), max_size=3),
                       st.integers(0, 2**32 - 1))
    counter = iter(range(10**6))

    @settings(max_examples=25, deadline=None)
    @given(st.dictionaries(st.text("abcxyz./_", min_size=1, max_size=6), tensor, min_size=1, max_size=5))
    def check(spec):
        d = tmp_path / str(next(counter))
        d.mkdir()
        tensors = {}
        for name, (dt, shape, seed) in spec.items():
            g = torch.Generator().manual_seed(seed)
            n = int(np.prod(shape)) if shape else 1
            raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8, generator=g)
            t = (raw % 2).bool() if dt == torch.bool else raw.view(dt)
            tensors[name] = t.reshape(shape)
        src = d / "m.safetensors"
        safetensors.torch.save_file(tensors, src)
        st_store = LfsStore(d / "objects")
        meta = clean_checkpoint(src, st_store, None)
        text = metadata.dumps(meta)
        assert metadata.dumps(clean_checkpoint(src, st_store, metadata.loads(text))) == text
        smudge_checkpoint(metadata.loads(text), st_store, d / "o.safetensors")
        back = safetensors.torch.load_file(d / "o.safetensors")
        assert set(back) == set(tensors)
        for k, v in tensors.items():
            assert same_bits(v, back[k]), k

    check()


def test_update_registry_and_reconstruct_cache(tmp_path, store):
    from theta import updates
    from theta.base.errors import UpdateTypeError
    from theta.updates import rebuild
    with pytest.raises(UpdateTypeError, match="unknown update type 'nope'.*dense"):
        updates.get("nope")
    assert "dense" in updates.names() and updates.get("dense").incremental is False
    safetensors.torch.save_file({"w": torch.randn(30, 30)}, tmp_path / "m.safetensors")
    meta = clean_checkpoint(tmp_path / "m.safetensors", store, None)
    g = meta.groups["w"]
    cache = {}
    v = rebuild.reconstruct(g, store, cache)
    assert updates.content_hash(v) == g.hash and cache[g.hash] is v
    store.path(g.steps[0].blob).unlink()
    assert rebuild.reconstruct(g, store, cache) is v  # served from the cache, no blob needed
    with pytest.raises(BlobMissingError):
        rebuild.reconstruct(g, store)


RSS_SCRIPT = r"""
import sys, json


def hwm():  # peak RSS of this process image in MiB (VmHWM resets at exec, unlike ru_maxrss)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


from theta.model.clean import clean_checkpoint
from theta.storage.metadata import dumps, loads
from theta.model.smudge import smudge_checkpoint
from theta.storage.store import LfsStore
import numpy, zipslice, zipslice.safetensors_format  # imported before the baseline is taken
base = hwm()
store = LfsStore(sys.argv[2])
if sys.argv[1] == "clean":
    open(sys.argv[4], "w").write(dumps(clean_checkpoint(sys.argv[3], store, None)))
else:
    smudge_checkpoint(loads(open(sys.argv[4]).read()), store, sys.argv[3])
print(json.dumps({"base": base, "peak": hwm()}))
"""


@pytest.mark.slow
def test_peak_memory_is_about_two_groups(tmp_path):
    """Two 192 MiB groups (above the read-ahead limit): clean and smudge each stay within 2 groups + 64 MiB
    above the interpreter (clean: the group and its frames in flight; smudge: the value and its mapped blob)."""
    import json
    import subprocess
    import sys
    group = 192 << 20
    arrs = {f"g{i}": (np.random.default_rng(i).standard_normal(group // 4) * 0.02).astype(np.float32) for i in range(2)}
    src = tmp_path / "big.safetensors"
    safetensors.numpy.save_file(arrs, src)
    del arrs
    objs, meta = tmp_path / "objects", tmp_path / "meta.txt"
    for step, path in (("clean", src), ("smudge", tmp_path / "out.safetensors")):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, step, str(objs), str(path), str(meta)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        grew = r["peak"] - r["base"]
        print(step, r)
        assert grew <= 2 * (group >> 20) + 64, f"{step} grew {grew:.0f} MiB for a {group >> 20} MiB group"
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("verify", ["hash", "frames"])
def test_streamed_smudge_records_the_crcs_computed_ahead(tmp_path, store, verify):
    """smudge_to_stream computes each group's CRC-32 on the rebuild thread (overlapping the writing of the
    group before): every record's CRC must match its bytes, and the tensors their originals bit for bit."""
    import io
    import zipfile

    from theta.model.smudge import smudge_to_stream

    rng = np.random.default_rng(3)
    sd = OrderedDict((f"w{i}", torch.from_numpy(rng.standard_normal((64, 32 + i), dtype=np.float32)))
                     for i in range(6))
    src = tmp_path / "m.pt"
    torch.save(sd, src)
    meta = clean_checkpoint(src, store, None, CleanOptions())
    for _ in range(2):  # the second run: frames mode trusts the groups bound by the first
        out = io.BytesIO()
        smudge_to_stream(meta, store, out, "m.pt", verify=verify)
        assert zipfile.ZipFile(io.BytesIO(out.getvalue())).testzip() is None
        got = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
        assert list(got) == list(sd) and all(same_bits(got[k], v) for k, v in sd.items())
