"""`git diff` / `git theta diff` statistics, frame by frame (theta.diff): both sides read block by block -- a
version's chain from its blobs, a work-tree file through zipslice's frames -- with the same numbers as the
whole arrays, the same value names and signatures as hashing the value whole, and a few frames of memory."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from theta.base import lsh
from theta.model import diff
from theta.model.diff import CheckpointSide, MetaSide, change_stats, diff_sides
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates import content_hash, stream

from support.traced import traced_peak
from test_merge_streaming import chain, tuned, weights


def reference(old: np.ndarray, new: np.ndarray):
    """The statistics in float64, written independently: whole arrays, numpy's own sums."""
    a, b = old.astype(np.float64).ravel(), new.astype(np.float64).ravel()
    d = b - a
    return (int(np.count_nonzero(old.ravel().view(np.uint32) != new.ravel().view(np.uint32))),
            math.sqrt(np.sum(d * d)), math.sqrt(np.sum(a * a)), float(np.max(np.abs(d))))


def versions(store, rng, shape):
    v = [weights(rng, shape)]
    v.append(tuned(rng, v[0]))
    v.append(v[1].copy())
    v[2].reshape(-1)[rng.choice(v[2].size, 30, replace=False)] = rng.standard_normal(30).astype(np.float32)
    old = chain(store, v[:2], ["delta"])
    new = chain(store, v, ["delta", "sparse"])
    return v[1], v[2], old, new


def test_streamed_statistics_equal_the_arrays_and_a_float64_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)
    store = LfsStore(tmp_path / "objects")
    a, b, ga, gb = versions(store, np.random.default_rng(1), (300, 257))
    whole = change_stats(a, b)
    metas = [MetaSide(CheckpointMeta(format="safetensors", order=["w"], groups={"w": g}), label, store=store)
             for g, label in ((ga, "old"), (gb, "new"))]
    streamed = change_stats(metas[0].value("w"), metas[1].value("w"))
    save_file({"w": b}, str(tmp_path / "b.safetensors"))
    f = CheckpointSide(tmp_path / "b.safetensors", "work tree")
    mixed = change_stats(metas[0].value("w"), f.value("w"))
    assert whole == streamed == mixed  # the same chunks summed in the same order: the same bits
    changed, l2, old_l2, max_abs = reference(a, b)
    assert whole.changed == changed and whole.max_abs == max_abs
    assert whole.l2 == pytest.approx(l2, rel=1e-12) and whole.old_l2 == pytest.approx(old_l2, rel=1e-12)
    # a work-tree file hashes and signs in blocks as it would whole
    assert f.hash("w") == content_hash(b) and f.hash("w", like="0" * 64) == content_hash(b, like="0" * 64)
    assert f.signature("w") == lsh.signature(b)
    report = diff_sides(metas[0], f, "m.safetensors")
    assert [g.stats for g in report.groups] == [whole]
    f.close()


def test_a_diff_holds_a_few_frames_not_the_values(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    monkeypatch.setattr(diff, "CHUNK", 1 << 15)  # its float64 temporaries small next to the group, as in real use
    store = LfsStore(tmp_path / "objects")
    a, b, ga, gb = versions(store, np.random.default_rng(2), (2048, 1024))  # 8 MiB
    size = a.nbytes
    del a, b
    sides = [MetaSide(CheckpointMeta(format="safetensors", order=["w"], groups={"w": g}), label, store=store)
             for g, label in ((ga, "old"), (gb, "new"))]
    report, peak = traced_peak(diff_sides, sides[0], sides[1], "m.safetensors")
    assert report.groups[0].stats.changed > 0
    assert peak < size / 2, peak / size  # before: both values whole (2 x size)


def test_a_file_side_reads_a_strided_tensor_frame_by_frame(tmp_path):
    x = torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3)
    torch.save({"w": x.transpose(0, 2)}, tmp_path / "s.pt")
    f = CheckpointSide(tmp_path / "s.pt", "s")
    got = np.concatenate([blk for _, blk in f.value("w").chunks(4)])
    assert np.array_equal(got, x.transpose(0, 2).contiguous().numpy().ravel())
    assert f.hash("w") == content_hash(np.ascontiguousarray(x.transpose(0, 2).numpy()))
    f.close()


def test_blocks_of_a_source_cover_its_value(tmp_path):
    store = LfsStore(tmp_path / "objects")
    a, b, ga, gb = versions(store, np.random.default_rng(3), (33, 17))
    got = np.concatenate([blk for _, blk in stream.blocks(stream.source(gb, store), 50)])
    assert np.array_equal(got.view(np.uint32), b.ravel().view(np.uint32))
