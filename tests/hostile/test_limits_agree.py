"""Writer and reader agree on every limit: what theta accepts it can write, what it writes zipslice reads
back, and what zipslice would refuse to read back is refused before it is written (at clean time, or by the
writer), so `git status` never meets a file it cannot clean."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import zipslice
from zipslice import TensorSource, torch_reader, torch_writer
from zipslice.errors import ZipsliceError

from theta.model.clean import clean_checkpoint
from theta.base.errors import CheckpointError, MetadataError
from theta.model.smudge import smudge_checkpoint
from theta.storage import schema
from theta.storage.metadata import dumps, loads
from theta.storage.store import LfsStore


def _nested(depth: int):
    obj = torch.ones(2)
    for _ in range(depth):
        obj = [obj]
    return obj


def test_the_limits_are_the_readers():
    assert schema.MAX_STRUCTURE_DEPTH == torch_reader.MAX_DEPTH
    assert schema.MAX_FILE_METADATA_BYTES == torch_reader.MAX_METADATA_BYTES


def test_the_deepest_structure_zipslice_reads_round_trips_through_theta(tmp_path):
    store = LfsStore(tmp_path / "objects")
    src = tmp_path / "deep.pt"
    torch.save({"x": _nested(torch_reader.MAX_DEPTH - 1)}, src)  # the leaf sits at depth MAX_DEPTH
    meta = loads(dumps(clean_checkpoint(src, store)))
    out = tmp_path / "out.pt"
    smudge_checkpoint(meta, store, out)
    got = torch.load(out, weights_only=True)["x"]
    for _ in range(torch_reader.MAX_DEPTH - 1):
        got = got[0]
    assert torch.equal(got, torch.ones(2))
    # one level more: zipslice refuses to read it, so theta never stores it
    torch.save({"x": _nested(torch_reader.MAX_DEPTH)}, src)
    with pytest.raises(CheckpointError, match="nested deeper than 200"):
        clean_checkpoint(src, store)


def test_torch_writer_refuses_what_its_reader_would(tmp_path):
    src = [TensorSource("w", "float32", (2,), read=lambda: np.zeros(2, np.float32).tobytes())]
    deep = {"tensor": "w"}
    for _ in range(torch_reader.MAX_DEPTH + 1):
        deep = {"list": [deep]}
    with pytest.raises(ZipsliceError, match="deeper than 200"):
        torch_writer.write(tmp_path / "a.pt", src, structure=deep)
    with pytest.raises(ZipsliceError, match="metadata would be .* over the 67108864"):
        torch_writer.write(tmp_path / "b.pt", src, metadata={"k": "x" * torch_reader.MAX_METADATA_BYTES})
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


def test_file_metadata_zipslice_cannot_read_back_is_refused_at_clean_time(tmp_path):
    """safetensors allows a 100 MB header; a 70 MB __metadata__ reads fine there, but as a torch checkout
    (theta-format=torch) it would exceed the 64 MiB record zipslice reads: theta refuses it when cleaning."""
    p = tmp_path / "big.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(p), metadata={"note": "x" * (70 << 20)})
    with zipslice.load(p) as lsd:
        assert len(lsd.metadata["note"]) == 70 << 20  # zipslice reads the source file
    meta = clean_checkpoint(p, LfsStore(tmp_path / "objects"))
    with pytest.raises(MetadataError, match="file-level metadata .* exceeds the limit of 67108864 bytes"):
        dumps(meta, file="big.safetensors")


def test_safetensors_writer_refuses_a_header_its_reader_would(tmp_path):
    from zipslice.safetensors_format import MAX_HEADER_BYTES, build_header

    src = [TensorSource("w", "float32", (1,), read=lambda: b"\0" * 4)]
    with pytest.raises(ValueError, match="over the 100000000-byte limit"):
        build_header(src, {"k": "x" * MAX_HEADER_BYTES})
