"""LazyCheckpoint.iter_plain: a tensor's bytes piece by piece through the caller's buffer, bit for bit what
read_bytes gives, for the formats that store plain spans; None where the bytes are not one plain span.
LazyCheckpoint.read_plain_into: any piece of those bytes, in any order, from any thread; sharded checkpoints
read both from their shards."""
import numpy as np
import pytest
import safetensors.numpy
import torch

import zipslice


def pieces_of(lsd, key, size):
    buf = bytearray(size)
    it = lsd.iter_plain(key, buf)
    return None if it is None else b"".join(bytes(p) for p in it)


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_safetensors_pieces_equal_read_bytes(tmp_path, piece):
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal((33, 7), dtype=np.float32), "b": np.arange(5, dtype=np.int16),
              "empty": np.zeros((0, 3), np.float32)}
    safetensors.numpy.save_file(arrays, str(tmp_path / "m.safetensors"))
    with zipslice.load(tmp_path / "m.safetensors") as lsd:
        for k, v in arrays.items():
            assert pieces_of(lsd, k, piece) == v.tobytes() == bytes(lsd.read_bytes(k))


def test_torch_pieces_equal_read_bytes_and_views_decline(tmp_path):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    torch.save({"w": base.clone(), "t": base.t(), "row": base[2], "bf": base.to(torch.bfloat16)}, tmp_path / "m.pt")
    with zipslice.load(tmp_path / "m.pt") as lsd:
        assert pieces_of(lsd, "w", 10) == bytes(lsd.read_bytes("w"))
        assert pieces_of(lsd, "bf", 10) == bytes(lsd.read_bytes("bf"))
        assert pieces_of(lsd, "t", 10) is None  # a transposed view: not one plain span
        got = pieces_of(lsd, "row", 10)  # a row of another tensor's storage: a plain span at its offset
        assert got is None or got == bytes(lsd.read_bytes("row"))


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    arrays = {"a": np.ones(1000, np.float32)}
    p = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(p))
    with zipslice.load(p) as lsd:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size - 100)
        with pytest.raises(zipslice.errors.CorruptCheckpointError, match="m.safetensors"):
            pieces_of(lsd, "a", 256)


def test_any_piece_of_the_plain_bytes_from_several_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(2)
    a = rng.standard_normal(100_000).astype(np.float32)
    p = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"a": a, "b": np.arange(3, dtype=np.int8)}, str(p))
    whole = a.tobytes()
    pieces = [(s, min(s + 7919, len(whole))) for s in range(0, len(whole), 7919)][::-1]  # backwards

    def read(span):
        buf = bytearray(span[1] - span[0])
        lsd.read_plain_into("a", span[0], buf)
        return span, bytes(buf)

    with zipslice.load(p) as lsd, ThreadPoolExecutor(4) as pool:
        for (s, e), got in pool.map(read, pieces):
            assert got == whole[s:e]
        with pytest.raises(ValueError, match="has no plain bytes"):
            lsd.read_plain_into("a", len(whole) - 4, bytearray(8))  # runs past the tensor's end


def test_a_sharded_checkpoint_reads_plain_bytes_from_its_shards(tmp_path):
    import json

    rng = np.random.default_rng(3)
    parts = {"model-00001-of-00002.safetensors": {"x": rng.standard_normal(5000).astype(np.float32)},
             "model-00002-of-00002.safetensors": {"y": np.arange(4000, dtype=np.int32)}}
    for name, arrays in parts.items():
        safetensors.numpy.save_file(arrays, str(tmp_path / name))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: n for n, a in parts.items() for k in a}}))
    with zipslice.load(index) as lsd:
        for name, arrays in parts.items():
            for k, v in arrays.items():
                file, _, nbytes = lsd.plain_range(k)
                assert file.endswith(name) and nbytes == v.nbytes
                assert pieces_of(lsd, k, 1000) == v.tobytes()
                buf = bytearray(100)
                lsd.read_plain_into(k, 40, buf)
                assert bytes(buf) == v.tobytes()[40:140]
