"""A checkout of blobs this machine has not proven -- every group of a fresh clone, of a version just pulled --
streams one-dense-step and split-keyframe groups frame by frame like proven ones (theta.model.smudge's
_FrameStream), hashing each value (and a split chain's first step) as its frames pass: the output is bit for bit
the checkpoint, the chains are bound for the next checkout, and a value whose blobs do not give its recorded
name fails the checkout naming the file, the group and the blob.

Real torch zip files written by zipslice, a real store; the store "from elsewhere" is the same objects without
this machine's bindings (theta-verified), as after a clone."""
from __future__ import annotations

import contextlib
import dataclasses
import shutil

import ml_dtypes
import numpy as np
import pytest

import zipslice

from theta.base.errors import BlobCorruptError
from theta.model import smudge
from theta.model.clean import clean_checkpoint
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates.rebuild import chain_bound, is_split_chain


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    big = (3 * codec.FRAME_BYTES) // 4 + 12345  # float32 elements: three frames and a part, a split keyframe
    return {"emb": (rng.standard_normal(big) * 0.02).astype(np.float32),
            "w_bf16": (rng.standard_normal((300, 2048)) * 0.02).astype(ml_dtypes.bfloat16),  # one dense step
            "bias": (rng.standard_normal(64) * 0.02).astype(np.float32),                     # too small to split
            "ids": np.arange(1000, dtype=np.int64)}


@pytest.fixture()
def cloned(tmp_path):
    """(arrays, metadata, a store holding the blobs without bindings, its path)."""
    arrays = model()
    path = tmp_path / "m.pt"
    zipslice.save(path, arrays, format="torch")
    made = LfsStore(tmp_path / "made" / "objects")
    meta = clean_checkpoint(path, made)
    assert is_split_chain(meta.groups["emb"]) and len(meta.groups["w_bf16"].steps) == 1
    objects = tmp_path / "clone" / "objects"
    shutil.copytree(made.objects_dir, objects)
    return arrays, meta, LfsStore(objects), tmp_path


def checkout(meta: CheckpointMeta, store: LfsStore, tmp_path, verify="frames") -> dict[str, np.ndarray]:
    out = tmp_path / "out.pt"
    with open(out, "wb") as f:
        smudge.smudge_to_stream(meta, store, f, "m.pt", verify=verify)
    with zipslice.load(out) as lsd:
        return {k: lsd.numpy(k) for k in lsd}


def same(got: dict, arrays: dict) -> bool:
    return set(got) == set(arrays) and all(got[k].dtype == arrays[k].dtype and got[k].tobytes() == arrays[k].tobytes()
                                           for k in arrays)


def test_unproven_groups_stream_frame_by_frame_hashed_and_are_then_bound(cloned, monkeypatch):
    arrays, meta, store, tmp_path = cloned
    assert not any(chain_bound(g, store) for g in meta.groups.values())
    streamed, hashed = [], []
    real_frames, real_hash = smudge._FrameStream._frames, smudge._hash_frame
    monkeypatch.setattr(smudge._FrameStream, "_frames",
                        lambda self, name, frames: streamed.append(name) or real_frames(self, name, frames))
    monkeypatch.setattr(smudge, "_hash_frame",
                        lambda value, frame, first, high: hashed.append((frame.nbytes, high is not None))
                        or real_hash(value, frame, first, high))
    assert same(checkout(meta, store, tmp_path), arrays)
    assert sorted(streamed) == sorted(arrays)  # every group: one dense step or a split chain
    # every byte of every value hashed, a split chain's first step beside it
    assert sum(n for n, _ in hashed) == sum(a.nbytes for a in arrays.values())
    assert sum(n for n, high in hashed if high) == arrays["emb"].nbytes
    smudge.parallel.pool("hash").submit(lambda: None).result()  # the bindings are written on the hash thread
    assert all(chain_bound(g, store) for g in meta.groups.values())
    # the next checkout trusts what it bound: nothing hashed, the same bytes
    hashed.clear()
    assert same(checkout(meta, store, tmp_path), arrays) and hashed == []
    # "hash" mode hashes even a bound value
    assert same(checkout(meta, store, tmp_path, verify="hash"), arrays)
    assert sum(n for n, _ in hashed) == sum(a.nbytes for a in arrays.values())


@pytest.mark.parametrize("group", ["emb", "w_bf16"])
def test_a_value_whose_blobs_give_another_fails_naming_file_group_and_blob(cloned, group):
    arrays, meta, store, tmp_path = cloned
    g = meta.groups[group]
    other = meta.groups["bias" if group == "emb" else "ids"].hash  # a real name of another value
    steps = [dataclasses.replace(s, hash=other) if i == len(g.steps) - 1 else s for i, s in enumerate(g.steps)]
    forged = dataclasses.replace(meta, groups={**meta.groups, group: dataclasses.replace(g, hash=other, steps=steps)})
    with pytest.raises(BlobCorruptError, match=rf"m\.pt: group '{group}' rebuilt from blob {g.steps[-1].blob.oid} "
                                               rf"does not match its content hash"):
        checkout(forged, store, tmp_path)
    smudge.parallel.pool("hash").submit(lambda: None).result()
    assert not chain_bound(forged.groups[group], store)


def test_a_split_chain_whose_first_step_is_misnamed_is_written_but_not_bound(cloned):
    """The value checks out (its name is right), so the file is good; its first step's name is not the value its
    blob gives, so neither step is bound and the next checkout hashes again."""
    arrays, meta, store, tmp_path = cloned
    g = meta.groups["emb"]
    steps = [dataclasses.replace(g.steps[0], hash=meta.groups["bias"].hash), g.steps[1]]
    misnamed = dataclasses.replace(meta, groups={**meta.groups, "emb": dataclasses.replace(g, steps=steps)})
    assert same(checkout(misnamed, store, tmp_path), arrays)
    smudge.parallel.pool("hash").submit(lambda: None).result()
    assert not chain_bound(misnamed.groups["emb"], store) and chain_bound(meta.groups["bias"], store)


def test_a_blob_cut_into_other_frames_than_its_chain_says_is_rebuilt_another_way(cloned, monkeypatch):
    """chain_frames answers None (here: for every group); the big one is then read block by block and hashed,
    never rebuilt whole, and the file is still right."""
    arrays, meta, store, tmp_path = cloned

    @contextlib.contextmanager
    def no_frames(*args, **kwargs):
        yield None

    monkeypatch.setattr(smudge, "chain_frames", no_frames)
    monkeypatch.setattr(smudge, "WHOLE_GROUP_BYTES", 1 << 20)
    whole = []
    real = smudge._Rebuilder.whole
    monkeypatch.setattr(smudge._Rebuilder, "whole", lambda self, name: whole.append(name) or real(self, name))
    assert same(checkout(meta, store, tmp_path), arrays)
    assert "emb" not in whole and "bias" in whole
