"""theta.load(path, rev=...).get_slice: a slice of a committed version decodes only the frames of its blobs the
slice covers (the chain read by position), bit for bit the slice of the rebuilt value, for every chain kind;
a chain of update types not read by position is rebuilt whole, then sliced. Real blobs in a real repository's
store (git init; no commit needed: the metadata is given)."""
from __future__ import annotations

import dataclasses
import subprocess

import ml_dtypes
import numpy as np
import pytest

from zipslice import frames
from zipslice.errors import ZipsliceError

import theta.model.lazy as lazy
from theta.model.lazy import ThetaCheckpoint
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates.rebuild import reconstruct

from support.traced import traced_peak
from test_merge_streaming import bits, chain, poked, tuned, weights

INDICES = [(), (slice(0, 3),), (5,), (slice(None), 7), (slice(2, 40, 3), slice(1, None, 5)), (Ellipsis, -1),
           (slice(90, 200),)]


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    return tmp_path / "r"


def versions(kind: str, rng, dtype=np.float32):
    a = weights(rng, (97, 61), dtype)
    if kind == "dense":
        return [a], []
    if kind == "delta+sparse":
        b = tuned(rng, a)
        return [a, b, poked(rng, b, 20)], ["delta", "sparse"]
    if kind == "rows moved":
        return [a, np.ascontiguousarray(a[::-1]), tuned(rng, np.ascontiguousarray(a[::-1]))], ["rows", "delta"]
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["dense", "delta+sparse", "rows moved"])
def test_a_slice_of_a_version_is_the_slice_of_its_value(repo, monkeypatch, kind, dtype):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)  # many frames: a slice covers a few of them
    store = LfsStore.for_repo(repo)
    values, types = versions(kind, np.random.default_rng(1), dtype)
    group = chain(store, values, types)
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": group})
    whole = reconstruct(group, store)
    with ThetaCheckpoint(repo / "m.safetensors", meta=meta, repo=repo, fetch=False, rev="HEAD") as lsd:
        sl = lsd.get_slice("w", framework="np")
        for index in INDICES:
            assert bits(sl[index]) == bits(whole[index]), index
        assert bits(lsd.numpy("w")) == bits(whole)


def test_a_slice_decodes_a_few_frames_not_the_group(repo, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    store = LfsStore.for_repo(repo)
    rng = np.random.default_rng(2)
    a = weights(rng, (2048, 1024))  # 8 MiB
    group = chain(store, [a, tuned(rng, a)], ["delta"])
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": group})
    want = reconstruct(group, store)[100:110]
    del a
    monkeypatch.setattr(lazy, "reconstruct", lambda *a, **k: pytest.fail("rebuilt whole"))
    with ThetaCheckpoint(repo / "m.safetensors", meta=meta, repo=repo, fetch=False, rev="HEAD") as lsd:
        got, peak = traced_peak(lambda: lsd.get_slice("w", framework="np")[100:110])
    assert bits(got) == bits(want)
    assert peak < 2 << 20, peak  # a frame per blob and the slice (40 KiB), not the 8 MiB value


def test_frames_of_a_version_come_from_one_pass_over_its_chain(repo, monkeypatch):
    """zipslice's frames of a version (convert, show, diff of REV:PATH) read its chain once, in order, checked
    against the group's name; never whole."""
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)
    store = LfsStore.for_repo(repo)
    values, types = versions("delta+sparse", np.random.default_rng(3))
    group = chain(store, values, types)
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": group})
    monkeypatch.setattr(lazy, "reconstruct", lambda *a, **k: pytest.fail("rebuilt whole"))
    with ThetaCheckpoint(repo / "m.safetensors", meta=meta, repo=repo, fetch=False, rev="HEAD") as lsd:
        got = np.concatenate(list(frames.iter_frames(lsd, "w", 1000)))
    assert bits(got) == bits(values[-1])
    forged = dataclasses.replace(group, hash="blake3:" + "0" * 64)
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": forged})
    with ThetaCheckpoint(repo / "m.safetensors", meta=meta, repo=repo, fetch=False, rev="HEAD") as lsd:
        with pytest.raises(ZipsliceError, match=r"m\.safetensors \[w\].*hash differs"):
            list(frames.iter_frames(lsd, "w", 1000))
