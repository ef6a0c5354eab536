"""Sparse steps (and the fixes of ia3/low-rank steps) applied frame by frame from their blobs: bit for bit what
applying the decoded parts gives, and a step changing half of a group (magnitude pruning to 50%: what `auto`
stores as sparse, its zeros compressing to nothing) no longer holds its indices and values whole (before:
gaps, values and int64 indices, two groups beside the value). Real blobs in a real store."""
import ml_dtypes
import numpy as np
import pytest

from theta.base.errors import ChainError, UpdateTypeError
from theta.storage import codec
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore
from theta.updates import content_hash, get, steps
from theta.updates.rebuild import reconstruct
from theta.updates.sparse import scatter_blobs
from support.traced import traced_peak


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def pruned(prev: np.ndarray, fraction: float) -> np.ndarray:
    out = prev.copy()
    flat = out.reshape(-1)
    flat[np.abs(flat.astype(np.float32)) < np.quantile(np.abs(flat.astype(np.float32)), fraction)] = 0
    return out


def sparse_chain(store, prev, new):
    enc = get("sparse").encode(new, prev)
    links = [steps.store_dense(prev, store), steps.store_step("sparse", enc.parts, enc.params, content_hash(new), store)]
    return GroupMeta(name="w", dtype=str(np.dtype(new.dtype)) if new.dtype != ml_dtypes.bfloat16 else "bfloat16",
                     shape=tuple(new.shape), hash=content_hash(new), steps=links)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64], ids=str)
@pytest.mark.parametrize("fraction", [0.0001, 0.3, 0.5])
def test_sparse_apply_blob_equals_apply(tmp_path, monkeypatch, dtype, fraction):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)  # many frames; values and gaps frames of different lengths
    rng = np.random.default_rng(1)
    prev = (rng.standard_normal((300, 70)) * 0.02).astype(dtype)
    new = pruned(prev, fraction)
    enc = get("sparse").encode(new, prev, lazy=False)
    blob = codec.encode_parts(enc.parts)
    want = get("sparse").apply(codec.decode_parts(blob), enc.params, prev)
    for in_place in (False, True):
        base = prev.copy()
        got = get("sparse").apply_blob(codec.part_blobs(memoryview(blob)), enc.params, base, in_place)
        assert bits(got) == bits(want) == bits(new)
        assert (got is base) == in_place
        if not in_place:
            assert bits(base) == bits(prev)


def test_half_changed_sparse_step_rebuilds_within_the_value_and_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 64 << 10)
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(2)
    prev = (rng.standard_normal((2048, 512)) * 0.02).astype(np.float32)  # 4 MiB
    new = pruned(prev, 0.5)
    group = sparse_chain(store, prev, new)
    assert group.steps[1].params["count"] >= 0.49 * new.size
    got, peak = traced_peak(reconstruct, group, store)
    assert bits(got) == bits(new)
    assert peak <= 1.25 * new.nbytes, peak / new.nbytes  # was ~3 x: the value, gaps, values, int64 indices


def test_forged_sparse_blobs_are_refused_before_or_while_applying(tmp_path):
    prev = np.zeros(100, np.float32)
    values = codec.encode_array(np.ones(3, np.float32))
    for gaps, problem in [(np.array([5, 3, 2], np.int64), None), (np.array([5, -9, 2], np.int64), "not increasing"),
                          (np.array([5, 3], np.uint32), "does not fit"), (np.array([99, 1, 1], np.uint32), "not increasing"),
                          (np.array([1.0, 2.0, 3.0], np.float32), "does not fit")]:
        out = prev.copy()
        if problem is None:
            scatter_blobs(codec.encode_array(gaps), values, out, "sparse update")
            assert np.flatnonzero(out).tolist() == [5, 8, 10]
            continue
        with pytest.raises(UpdateTypeError, match=problem):
            scatter_blobs(codec.encode_array(gaps), values, out, "sparse update")


def test_forged_sparse_step_in_a_chain_is_a_located_chain_error(tmp_path):
    store = LfsStore(tmp_path / "objects")
    prev = np.zeros((10, 10), np.float32)
    new = prev.copy()
    new[1, 1] = 1
    group = sparse_chain(store, prev, new)
    forged = steps.store_step("sparse", {"gaps": np.array([11, -5], np.int64), "values": np.ones(2, np.float32)},
                              {"count": 2}, content_hash(new), store)
    import dataclasses
    bad = dataclasses.replace(group, steps=[group.steps[0], forged])
    with pytest.raises(ChainError, match="'w'"):
        reconstruct(bad, store, file="m.pt")
