"""The worked plugin examples of docs/extending.md (docs/examples/*.py) work as the page says.

Each example is registered in the real registry (as its entry point would register it once installed) and
driven through the real code paths: zipslice.load/save/convert for the format; clean_checkpoint and
smudge_checkpoint with a real blob store for the update type; plan_merge/execute for the merge strategy.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import theta
import theta.merges
import theta.updates
import zipslice
from zipslice import formats
from zipslice.convert import convert

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


# -- a checkpoint format -------------------------------------------------------------------------------------
@pytest.fixture
def npy_format(monkeypatch):
    spec = formats.FormatSpec("npy", "npy_format:NpyCheckpoint", "npy_format:write", (".npy",),
                              detect="npy_format:detect")
    monkeypatch.setitem(formats.registry(), "npy", spec)
    return spec


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", "<i2", "|u1", "|b1", "<c8"])
def test_npy_format_reads_what_numpy_wrote(tmp_path, npy_format, dtype):
    arr = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    np.save(tmp_path / "a.npy", arr)
    with zipslice.load(tmp_path / "a.npy") as lsd:
        assert lsd.format == "npy" and list(lsd) == ["array"]
        got = lsd.numpy("array")
        assert got.shape == (2, 3, 4)
        assert got.astype(arr.dtype.newbyteorder("=")).tobytes() == arr.astype(arr.dtype.newbyteorder("=")).tobytes()


def test_npy_format_writes_and_converts_bit_for_bit(tmp_path, npy_format):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    save_file({"w": w}, str(tmp_path / "one.safetensors"))
    with zipslice.load(tmp_path / "one.safetensors") as lsd:
        zipslice.save(tmp_path / "w.npy", lsd)                  # the format comes from the extension
    assert np.load(tmp_path / "w.npy").tobytes() == w.tobytes()
    convert(tmp_path / "w.npy", tmp_path / "back.safetensors")
    assert load_file(str(tmp_path / "back.safetensors"))["array"].tobytes() == w.tobytes()
    with pytest.raises(ValueError, match="holds one array, got 2 tensors"):
        zipslice.save(tmp_path / "two.npy", {"a": w, "b": w})
    assert not (tmp_path / "two.npy").exists()


def test_npy_format_refuses_untrusted_input_by_name(tmp_path, npy_format):
    np.save(tmp_path / "full.npy", np.zeros(1000, np.float32))
    data = (tmp_path / "full.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-100])
    with pytest.raises(zipslice.CorruptCheckpointError, match="truncated") as e:
        zipslice.load(tmp_path / "cut.npy")
    assert e.value.path == str(tmp_path / "cut.npy")
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(zipslice.UnsupportedCheckpointError, match="dtype object"):
        zipslice.load(tmp_path / "obj.npy")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}     \n")
    with pytest.raises(zipslice.CorruptCheckpointError, match="bad .npy header"):
        zipslice.load(tmp_path / "bad.npy")


# -- an update type ------------------------------------------------------------------------------------------
@pytest.fixture
def scale_update(monkeypatch):
    theta.updates.get.cache_clear()
    monkeypatch.setitem(theta.updates._entry_points(), "scale",
                        EntryPoint("scale", "scale_update:ScaleUpdate", theta.updates.GROUP))
    yield
    theta.updates.get.cache_clear()


def test_scale_update_stores_a_rescaled_group_as_one_number(tmp_path, scale_update):
    store = theta.LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(1)
    v1 = {"layer.weight": rng.standard_normal((256, 64)).astype(np.float32),
          "other.weight": rng.standard_normal((64, 64)).astype(np.float32)}
    save_file(v1, str(tmp_path / "v1.safetensors"))
    meta1 = theta.clean_checkpoint(tmp_path / "v1.safetensors", store)

    v2 = {"layer.weight": v1["layer.weight"] * np.float32(0.5),               # a rescaled layer
          "other.weight": v1["other.weight"] + np.float32(0.25)}              # not a rescaling
    save_file(v2, str(tmp_path / "v2.safetensors"))
    meta2 = theta.clean_checkpoint(tmp_path / "v2.safetensors", store, meta1,
                                   theta.CleanOptions(update_type="scale"))

    scaled = meta2.groups["layer.weight"].steps
    assert [s.type for s in scaled] == ["dense", "scale"]
    assert scaled[-1].blob.size < 1024                     # one float64 and the blob framing, not 64 KiB
    assert [s.type for s in meta2.groups["other.weight"].steps] == ["dense"]  # declined: stored dense

    text = theta.dumps_metadata(meta2)
    theta.smudge_checkpoint(theta.loads_metadata(text), store, tmp_path / "out.safetensors")
    out = load_file(str(tmp_path / "out.safetensors"))
    for name, value in v2.items():
        assert out[name].tobytes() == value.tobytes()


# -- a merge strategy ----------------------------------------------------------------------------------------
@pytest.fixture
def largest_change(monkeypatch):
    theta.merges.get.cache_clear()
    monkeypatch.setitem(theta.merges._entry_points(), "largest-change",
                        EntryPoint("largest-change", "largest_change_merge:LargestChange",
                                   theta.merges.ENTRY_POINT_GROUP))
    yield
    theta.merges.get.cache_clear()


def test_largest_change_merges_through_plan_and_execute(tmp_path, largest_change):
    assert "largest-change" in theta.merge_strategies()
    assert "largest-change" in theta.merges.applicable("bfloat16", has_ancestor=True)
    assert "largest-change" not in theta.merges.applicable("int32", has_ancestor=True)

    store = theta.LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(2)
    base = rng.standard_normal((32, 16)).astype(np.float32)
    ours = base + rng.normal(0, 0.01, base.shape).astype(np.float32)
    theirs = base + rng.normal(0, 0.01, base.shape).astype(np.float32)
    metas = {}
    for label, value in (("base", base), ("ours", ours), ("theirs", theirs)):
        save_file({"w": value}, str(tmp_path / f"{label}.safetensors"))
        metas[label] = theta.clean_checkpoint(tmp_path / f"{label}.safetensors", store)

    plan = theta.plan_merge(metas["base"], metas["ours"], metas["theirs"], "model.safetensors")
    assert [p.name for p in plan.pending] == ["w"] and not plan.conflicts
    for p in plan.pending:
        p.strategy = "largest-change"
    merged = theta.execute_merge(plan, store)
    theta.smudge_checkpoint(merged, store, tmp_path / "merged.safetensors")

    b, o, t = base.astype(np.float32), ours, theirs
    expected = np.where(np.abs(o - b) >= np.abs(t - b), o, t)
    assert load_file(str(tmp_path / "merged.safetensors"))["w"].tobytes() == expected.tobytes()
