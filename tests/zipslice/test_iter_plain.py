"""LazyCheckpoint.iter_plain: a tensor's bytes piece by piece through the caller's buffer, bit for bit what
read_bytes gives, for the formats that store plain spans; None where the bytes are not one plain span."""
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
