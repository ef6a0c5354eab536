"""theta.model.smudge.smudge_sharded without git: a committed checkpoint written as shards by each shard format's
own library's rules, ties kept within a shard, refusals that leave nothing, and the way back
(theta.model.views.clean_as_committed of the index) giving the committed metadata exactly."""
from __future__ import annotations

import json
import os
from collections import OrderedDict

import h5py
import pytest
import torch

from support import formats
from support.formats import same_bits
from theta.model.clean import clean_checkpoint
from theta.base.errors import ThetaError, ViewError
from theta.model.smudge import smudge_sharded
from theta.storage.store import LfsStore
from theta.model.views import clean_as_committed


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "objects")


def tied_torch(path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = OrderedDict()
    sd["embed"] = torch.randn(16, 8, generator=g)
    sd["mid"] = torch.randn(16, 8, generator=g)
    sd["head"] = sd["embed"]
    sd["last"] = torch.randn(4, dtype=torch.float64, generator=g)
    torch.save({"model": sd, "step": 7}, path)
    return {f"model/{k}": v for k, v in sd.items()}


@pytest.mark.parametrize("ext,fmt", [(".safetensors", "safetensors"), (".bin", "torch"), (".h5", "hdf5")])
def test_shards_round_trip(tmp_path, store, ext, fmt):
    want = tied_torch(tmp_path / "m.pt")
    committed = clean_checkpoint(tmp_path / "m.pt", store)
    out = tmp_path / "out"
    out.mkdir()
    index = out / f"m{ext}.index.json"
    shards = smudge_sharded(committed, store, index, max_shard_bytes=16 * 8 * 4)  # one 16x8 float32 a shard
    weight_map = json.loads(index.read_text())["weight_map"]
    assert sorted(os.path.basename(s) for s in shards) == sorted(set(weight_map.values())) and len(shards) == 3
    assert sorted(os.listdir(out)) == sorted([index.name] + [os.path.basename(s) for s in shards])
    assert weight_map["model/head"] == weight_map["model/embed"]  # a tie stays within one shard
    got = {}
    for s in shards:
        part = formats.read(s, fmt)  # the shard format's own library
        assert all(weight_map[k] == os.path.basename(s) for k in part)
        got.update(part)
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    tied_shard = out / weight_map["model/embed"]
    if fmt == "torch":
        part = formats.torch_load(tied_shard)
        assert part["model/head"].untyped_storage().data_ptr() == part["model/embed"].untyped_storage().data_ptr()
    elif fmt == "hdf5":
        with h5py.File(tied_shard, "r") as f:  # one dataset, two names (a hard link)
            assert f["model/head"].id == f["model/embed"].id and h5py.h5o.get_info(f["model/embed"].id).rc == 2
    # the way back: the shards are a view of the committed file (its structure and `step` are kept)
    assert clean_as_committed(index, store, committed) == committed


def test_refusal_leaves_nothing(tmp_path, store):
    torch.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.pt")
    committed = clean_checkpoint(tmp_path / "c.pt", store)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ViewError, match="'c'.*complex128"):
        smudge_sharded(committed, store, out / "c.safetensors.index.json")
    with pytest.raises(ThetaError, match="shard format"):
        smudge_sharded(committed, store, out / "c.npz.index.json")
    assert os.listdir(out) == []
