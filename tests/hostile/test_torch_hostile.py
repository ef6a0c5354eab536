"""Hostile and corrupt torch checkpoints (fixtures/torch/, made by fixtures/make_torch_fixtures.py).

Each must raise the right zipslice error naming the file (and the entry where there is one), without
running anything, crashing, hanging, or allocating much more than the file's size.
"""
from __future__ import annotations

import io
import os
import struct
import tracemalloc
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import zipslice
from zipslice.errors import (CorruptCheckpointError, NotACheckpointError, UnsafeCheckpointError,
                             UnsupportedCheckpointError, ZipsliceError)

from support import FIXTURES

HOSTILE = FIXTURES / "torch"
MARKER = "zipslice_pwned_marker"
PKL = "archive/data.pkl"

# fixture -> (error class, message fragment, entry it must name (None: no entry))
CASES = {
    "evil_os_system.pt": (UnsafeCheckpointError, r"(posix|os)\.system", PKL),
    "evil_os_system_proto4.pt": (UnsafeCheckpointError, r"(posix|os)\.system", PKL),
    "evil_eval.pt": (UnsafeCheckpointError, r"(__builtin__|builtins)\.eval", PKL),
    "evil_exec.pt": (UnsafeCheckpointError, r"(__builtin__|builtins)\.exec", PKL),
    "evil_subprocess.pt": (UnsafeCheckpointError, r"subprocess\.check_output", PKL),
    "evil_in_persistent_id.pt": (UnsafeCheckpointError, r"posix\.system", PKL),
    "evil_lookalike_module.pt": (UnsafeCheckpointError, r"torch\._utils_evil\._rebuild_tensor_v2", PKL),
    "truncated.pt": (CorruptCheckpointError, "truncated", None),
    "bad_central_directory.pt": (CorruptCheckpointError, "central directory", None),
    "eocd_offset_past_end.pt": (CorruptCheckpointError, "central directory", None),
    "no_data_pkl.pt": (CorruptCheckpointError, "no data.pkl", None),
    "missing_record.pt": (CorruptCheckpointError, "data/7 is missing", "w"),
    "record_size_mismatch.pt": (CorruptCheckpointError, "has 24 bytes but the pickle declares", "w"),
    "span_beyond_record.pt": (CorruptCheckpointError, "reaches byte 36 but its storage", "w"),
    "huge_shape_claim.pt": (CorruptCheckpointError, "but its storage", "w"),
    "huge_storage_claim.pt": (CorruptCheckpointError, "pickle declares", "w"),
    "negative_stride.pt": (CorruptCheckpointError, "negative", "w"),
    "bad_byteorder.pt": (CorruptCheckpointError, "byteorder", "archive/byteorder"),
    "huge_binunicode.pt": (CorruptCheckpointError, "claims 2147483647 bytes", PKL),
    "huge_binbytes8.pt": (CorruptCheckpointError, "claims 4611686018427387904 bytes", PKL),
    "huge_long4.pt": (CorruptCheckpointError, "claims 2147483647 bytes", PKL),
    "unknown_opcode.pt": (CorruptCheckpointError, "unknown pickle opcode 0xff", PKL),
    "stack_underflow.pt": (CorruptCheckpointError, "malformed pickle", PKL),
    "memo_missing.pt": (CorruptCheckpointError, "memo key 5", PKL),
    "billion_laughs.pt": (CorruptCheckpointError, "expands far beyond", PKL),
    "deep_nesting.pt": (UnsupportedCheckpointError, "nested deeper", "0/0/0"),
    "self_reference.pt": (UnsupportedCheckpointError, "nested deeper", "0/0/0"),
    "data_pkl_size_claim.pt": (CorruptCheckpointError, "more than the", PKL),
    "lfs_pointer.pt": (NotACheckpointError, "Git LFS pointer", None),
}


def test_every_fixture_has_a_case():
    assert sorted(p.name for p in HOSTILE.glob("*.pt")) == sorted(
        list(CASES) + ["data_pkl_bomb.pt", "record_bomb.pt"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_fixture_is_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # payloads would create the marker here
    cls, fragment, entry = CASES[name]
    path = HOSTILE / name
    tracemalloc.start()
    try:
        with pytest.raises(cls, match=fragment) as exc:
            with zipslice.load(path) as lsd:
                for key in lsd:
                    lsd[key]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = exc.value
    assert err.path == str(path) and str(path) in str(err)
    if entry is None:
        assert err.entry is None
    else:
        assert err.entry is not None and err.entry.startswith(entry)
    # linear in the file: at most one small Python object per pickle byte, never a claimed length
    assert peak < 64 * os.path.getsize(path) + (2 << 20), f"allocated {peak} bytes"
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("name", ["evil_os_system.pt", "evil_subprocess.pt", "evil_eval.pt"])
def test_torch_itself_also_refuses_them(name):
    # sanity check of the fixtures: they are really unsafe by torch's own standard
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(HOSTILE / name, weights_only=True)


@pytest.mark.parametrize("name", ["data_pkl_bomb.pt", "record_bomb.pt"])
def test_deflate_bombs_inflate_only_the_declared_size(name, tmp_path):
    path = HOSTILE / name
    tracemalloc.start()
    try:
        with zipslice.load(path) as lsd:
            w = lsd["w"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(w, torch.arange(6.0).reshape(2, 3))
    assert peak < (3 << 20), f"allocated {peak} bytes for a {os.path.getsize(path)}-byte file"


def _valid_file(tmp_path):
    sd = {"w": torch.arange(6.0).reshape(2, 3), "n": {"b": torch.ones(2, dtype=torch.int64)}, "k": 3}
    torch.save(sd, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


def _with_pickle(good: bytes, pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as zin, zipfile.ZipFile(buf, "w") as zout:
        for n in zin.namelist():
            zout.writestr(n, pkl if n.endswith("data.pkl") else zin.read(n))
    return buf.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_pickles_fail_cleanly(tmp_path, data):
    good = _valid_file(tmp_path)
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        pkl = bytearray(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(pkl) - 1))
        pkl[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        pkl = pkl[: data.draw(st.integers(0, len(pkl)))]
    p = tmp_path / "mut.pt"
    p.write_bytes(_with_pickle(good, bytes(pkl)))
    try:
        with zipslice.load(p) as lsd:
            for k in lsd:
                lsd[k]
    except ZipsliceError as e:
        assert e.path == str(p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_archives_fail_cleanly(tmp_path, data):
    blob = bytearray(_valid_file(tmp_path))
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(1, len(blob)))]
    p = tmp_path / "mut.pt"
    p.write_bytes(bytes(blob))
    try:
        with zipslice.load(p) as lsd:
            for k in lsd:
                lsd[k]
    except ZipsliceError as e:
        assert e.path == str(p)


def test_random_garbage_pickles_fail_cleanly(tmp_path):
    """Each garbage pickle is refused with an error naming the file, or it is a well-formed pickle (pickletools,
    which never executes one, can walk it); and garbage is almost always refused."""
    import pickletools

    good = _valid_file(tmp_path)
    rng = __import__("random").Random(1234)
    refused = 0
    for i in range(300):
        pkl = b"\x80\x02" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) + b"."
        p = tmp_path / "g.pt"
        p.write_bytes(_with_pickle(good, pkl))
        try:
            with zipslice.load(p) as lsd:
                for k in lsd:
                    lsd[k]
        except ZipsliceError as e:
            assert e.path == str(p), e
            refused += 1
        else:
            pickletools.dis(pkl, out=__import__("io").StringIO())  # accepted: must be a well-formed pickle
    assert refused >= 290, f"only {refused} of 300 garbage pickles were refused"


def test_eocd_comment_and_fake_signature_in_comment(tmp_path):
    good = _valid_file(tmp_path)
    # a zip comment that itself contains an end-record signature must not confuse the search
    fake = b"PK\x05\x06" + b"\x00" * 18
    comment = b"note " + fake + b" end"
    data = bytearray(good)
    eocd = data.rfind(b"PK\x05\x06")
    struct.pack_into("<H", data, eocd + 20, len(comment))
    p = tmp_path / "c.pt"
    p.write_bytes(bytes(data) + comment)
    with zipslice.load(p) as lsd:
        assert torch.equal(lsd["w"], torch.arange(6.0).reshape(2, 3))
