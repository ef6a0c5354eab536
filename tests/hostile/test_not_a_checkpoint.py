"""Files that are not checkpoints get an error that says what the file actually is."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import zipslice
from zipslice.errors import CorruptCheckpointError, NotACheckpointError, UnsupportedCheckpointError

LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
               b"size 12345\n")


@pytest.mark.parametrize("name,content,fragment", [
    ("model.safetensors", LFS_POINTER, "Git LFS pointer"),
    ("model.bin", b"", "empty (0 bytes)"),
    ("model.pt", b"<!DOCTYPE html>\n<html><body>404 Not Found</body></html>", "HTML"),
    ("model.h5", b"  \n<html><head><title>Sign in</title></head></html>", "HTML"),
    ("model.ckpt", b"<?xml version='1.0'?><Error><Code>AccessDenied</Code></Error>", "HTML/XML"),
    ("config.json", b'{"hidden_size": 384, "num_attention_heads": 12}', "unrecognised file"),
    ("notes.txt", b"just some text\n", "unrecognised file"),
])
def test_not_a_checkpoint(tmp_path, name, content, fragment):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(NotACheckpointError) as exc:
        zipslice.load(p)
    assert fragment in str(exc.value) and str(p) in str(exc.value)
    assert isinstance(exc.value, CorruptCheckpointError)  # callers catching corrupt files catch these too


def test_lfs_pointer_says_how_to_fix_it(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(LFS_POINTER)
    with pytest.raises(NotACheckpointError, match="git lfs pull"):
        zipslice.sniff(p)


def test_random_bytes(tmp_path):
    blob = np.random.default_rng(1234).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert blob[8:9] != b"{" and not blob.startswith((b"PK", b"\x89HDF", b"\x80"))
    p = tmp_path / "random.bin"
    p.write_bytes(blob)
    with pytest.raises(NotACheckpointError, match="unrecognised file: first bytes"):
        zipslice.load(p)


def test_bare_pickle_is_named_as_such(tmp_path):
    p = tmp_path / "old.pkl"
    p.write_bytes(pickle.dumps({"w": [1, 2, 3]}, protocol=4))
    with pytest.raises(UnsupportedCheckpointError, match="bare pickle"):
        zipslice.load(p)


def test_truncated_safetensors_is_called_truncated(tmp_path):
    import safetensors.numpy

    full = tmp_path / "full.safetensors"
    safetensors.numpy.save_file({"w": np.arange(64, dtype="<f4")}, str(full))
    head = full.read_bytes()[:20]  # cut inside the JSON header
    p = tmp_path / "cut.safetensors"
    p.write_bytes(head)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        zipslice.load(p)
    p.write_bytes(full.read_bytes()[:-10])  # cut inside the data
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        zipslice.load(p)


def test_json_text_with_a_brace_at_byte_8_is_not_safetensors(tmp_path):
    p = tmp_path / "meta.json"
    p.write_bytes(b'{"tens":{"a": 1}}\n')
    assert p.read_bytes()[8:9] == b"{"
    with pytest.raises(NotACheckpointError, match="unrecognised"):
        zipslice.load(p)
