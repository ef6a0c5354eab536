"""Sharded checkpoints (Hugging Face *.index.json): one lazy map over shards written by the real libraries."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import zipslice
import zipslice.sharded
from zipslice.errors import CorruptCheckpointError
from zipslice.sharded import ShardedCheckpoint


def _model(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(10, 4, generator=g)}
    for i in range(3):
        out[f"layers.{i}.weight"] = torch.randn(4, 4, generator=g)
        out[f"layers.{i}.bias"] = torch.randn(4, generator=g).to(torch.bfloat16)
    out["head.weight"] = torch.randn(2, 4, generator=g).half()
    return out


def _write_sharded(tmp_path, tensors, kind="safetensors", shards=3):
    """Split like transformers' save_pretrained: shard files plus an index with a sorted weight_map."""
    names = list(tensors)
    ext = "safetensors" if kind == "safetensors" else "bin"
    stem = "model" if kind == "safetensors" else "pytorch_model"
    weight_map, total = {}, 0
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"{stem}-{s + 1:05d}-of-{shards:05d}.{ext}"
        if kind == "safetensors":
            safetensors.torch.save_file(part, str(tmp_path / fname), metadata={"format": "pt"})
        else:
            torch.save(part, tmp_path / fname)
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = tmp_path / f"{stem}.{ext}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                                indent=2))
    return index


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_safetensors_shards_open_lazily_and_match(tmp_path):
    tensors = _model()
    index = _write_sharded(tmp_path, tensors)
    assert zipslice.sniff(index) == "sharded"
    with zipslice.load(index) as lsd:
        assert isinstance(lsd, ShardedCheckpoint) and lsd.format == "sharded"
        assert list(lsd) == sorted(tensors) and len(lsd) == len(tensors)
        assert len(lsd.shard_files) == 3 and lsd.opened_shards == []
        assert lsd.index_metadata["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        info = lsd.info("layers.1.weight")
        assert lsd.opened_shards == [lsd.shard_of("layers.1.weight")] == [info.file]
        with safetensors.safe_open(info.file, framework="pt") as ref:
            want = ref.get_tensor("layers.1.weight")
        assert _bits(lsd["layers.1.weight"]) == _bits(want)
        for name, t in tensors.items():
            got = lsd[name]
            assert got.dtype == t.dtype and _bits(got) == _bits(t), name
        assert sorted(lsd.opened_shards) == sorted(lsd.shard_files)


def test_sharded_streams_into_one_file_identical_to_the_library(tmp_path):
    tensors = _model(1)
    index = _write_sharded(tmp_path, tensors)
    merged = tmp_path / "merged.safetensors"
    with zipslice.load(index) as lsd:
        zipslice.save(merged, lsd)
    ref = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(tensors, str(ref))
    assert merged.read_bytes() == ref.read_bytes()


def test_torch_shards(tmp_path):
    tensors = _model(2)
    index = _write_sharded(tmp_path, tensors, kind="torch", shards=2)
    with zipslice.load(index) as lsd:
        assert lsd.opened_shards == []
        for name in lsd:
            want = torch.load(lsd.shard_of(name), weights_only=True)[name]
            got = lsd[name]
            assert got.dtype == want.dtype and _bits(got) == _bits(want), name
            assert lsd.info(name).file == lsd.shard_of(name)


def test_missing_shard_names_index_shard_and_tensor(tmp_path):
    index = _write_sharded(tmp_path, _model())
    with zipslice.load(index) as lsd:
        victim = lsd.shard_of("head.weight")
        (tmp_path / victim).unlink()
        assert "head.weight" in lsd  # listing still works without touching shards
        with pytest.raises(CorruptCheckpointError) as exc:
            lsd.info("head.weight")
        msg = str(exc.value)
        assert str(index) in msg and victim in msg and "head.weight" in msg and "does not exist" in msg


def test_name_mapped_to_the_wrong_shard(tmp_path):
    index = _write_sharded(tmp_path, _model())
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = data["weight_map"]["embed.weight"]
    index.write_text(json.dumps(data))
    with zipslice.load(index) as lsd:
        with pytest.raises(CorruptCheckpointError, match="which has no such tensor") as exc:
            lsd["ghost.weight"]
        assert exc.value.entry == "ghost.weight" and data["weight_map"]["embed.weight"] in str(exc.value)


@pytest.mark.parametrize("body,msg", [
    ('{"weight_map": {"a": "../outside.safetensors"}}', "outside the index"),
    ('{"weight_map": {"a": "/etc/passwd"}}', "outside the index"),
    ('{"weight_map": {"a": 3}}', "not a file name"),
    ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "duplicate key"),
    ('{"weight_map": ["a"]}', "no \\\"weight_map\\\" object"),
    ('{"metadata": {}, "weight_map": {"a": "x", }', "not valid"),
])
def test_bad_index(tmp_path, body, msg):
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(body)
    with pytest.raises(CorruptCheckpointError, match=msg):
        ShardedCheckpoint(p)


def test_shard_that_is_an_index(tmp_path):
    inner = tmp_path / "inner.index.json"
    inner.write_text('{"weight_map": {"a": "x.safetensors"}}')
    outer = tmp_path / "outer.index.json"
    outer.write_text('{"weight_map": {"a": "inner.index.json"}}')
    with zipslice.load(outer) as lsd, pytest.raises(CorruptCheckpointError, match="itself an index"):
        lsd.info("a")


# -- writer --------------------------------------------------------------------------------------------

def test_write_sharded_safetensors_like_save_pretrained(tmp_path):
    tensors = _model(3)
    index = tmp_path / "model.safetensors.index.json"
    zipslice.save(index, tensors, metadata={"format": "pt"}, max_shard_bytes=200)
    data = json.loads(index.read_text())
    shards = sorted(set(data["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert list(data["weight_map"]) == sorted(tensors)
    assert data["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:  # every shard is a normal safetensors file, within the size limit unless one tensor
        loaded = safetensors.torch.load_file(str(tmp_path / shard))
        with safetensors.safe_open(str(tmp_path / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        size = sum(t.numel() * t.element_size() for t in loaded.values())
        assert size <= 200 or len(loaded) == 1
        for name, t in loaded.items():
            assert data["weight_map"][name] == shard and _bits(t) == _bits(tensors[name])
    with zipslice.load(index) as lsd:
        assert sorted(lsd) == sorted(tensors)
        assert all(_bits(lsd[n]) == _bits(t) for n, t in tensors.items())


def test_write_sharded_torch_keeps_ties_in_one_shard(tmp_path):
    tensors = _model(4)
    tensors["lm_head.weight"] = tensors["embed.weight"]  # tied, as in many language models
    index = tmp_path / "pytorch_model.bin.index.json"
    zipslice.save(index, tensors, max_shard_bytes=100)
    data = json.loads(index.read_text())
    assert data["weight_map"]["lm_head.weight"] == data["weight_map"]["embed.weight"]
    assert data["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for n, t in tensors.items() if n != "lm_head.weight")
    shard = torch.load(tmp_path / data["weight_map"]["embed.weight"], weights_only=True)
    assert shard["lm_head.weight"].untyped_storage().data_ptr() == shard["embed.weight"].untyped_storage().data_ptr()
    for name, fname in data["weight_map"].items():
        got = torch.load(tmp_path / fname, weights_only=True)[name]
        assert fname.startswith("pytorch_model-") and fname.endswith(".bin")
        assert _bits(got) == _bits(tensors[name])


def test_resharding_round_trip_is_lossless(tmp_path):
    tensors = _model(5)
    src = _write_sharded(tmp_path, tensors)
    out = tmp_path / "out" / "model.safetensors.index.json"
    out.parent.mkdir()
    with zipslice.load(src) as lsd:
        zipslice.save(out, lsd, max_shard_bytes=1000)
    merged = tmp_path / "merged.safetensors"
    with zipslice.load(out) as lsd:
        zipslice.save(merged, lsd)
    ref = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(tensors, str(ref))
    assert merged.read_bytes() == ref.read_bytes()


def test_write_sharded_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="index.json"):
        zipslice.sharded.write(tmp_path / "model.safetensors", [])
    with pytest.raises(ValueError, match="shard format"):
        zipslice.save(tmp_path / "model.npz.index.json", {"a": torch.zeros(1)})
