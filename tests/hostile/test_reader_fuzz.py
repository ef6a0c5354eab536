"""Bounded mutation fuzz of every zipslice reader (the torch zip reader has its own in test_torch_hostile.py).

A small valid file of each format is mutated (bytes flipped, truncated) and read completely. The reader must
give a ZipsliceError naming the file, or values; never another exception, never an allocation far beyond
the file's size. HDF5 is read with ``isolate=True`` (libhdf5 may hang or crash on such files: that must
come back as an error, within the time limit).
"""
from __future__ import annotations

import json
import os
import pickle
import time
import tracemalloc

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.numpy import load_file, save_file

import zipslice
from zipslice.errors import ZipsliceError

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _mutate(data: bytes, draw) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(buf) - 1))
        buf[i] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        buf = buf[: draw(st.integers(1, len(buf)))]
    return bytes(buf)


def _read_all(path, **kw) -> None:
    with zipslice.load(path, **kw) as lsd:
        for k in lsd:
            lsd.info(k)
            lsd.numpy(k, raw=True)
        _ = lsd.metadata, lsd.extras, lsd.structure


def _check(path, budget: int, **kw) -> None:
    tracemalloc.start()
    try:
        _read_all(path, **kw)
    except ZipsliceError as e:
        assert e.path is not None and os.path.basename(e.path) in str(e), str(e)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < budget, f"allocated {peak} bytes"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("readers")
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((8, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int64)},
              str(d / "m.safetensors"), metadata={"format": "np"})
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "n": {"i": torch.ones(2, dtype=torch.int16)}, "k": 3},
               d / "legacy.pt", _use_new_zipfile_serialization=False)
    with h5py.File(d / "m.h5", "w", track_order=True) as f:
        f["a"] = np.arange(32, dtype=np.float32).reshape(4, 8)
        f.create_dataset("g/b", data=np.arange(200, dtype=np.int64), chunks=(20,), compression="gzip")
        f["s"] = "text"
        f.attrs["meta"] = "x"
    save_file({"x": np.ones(4, np.float32)}, str(d / "s1.safetensors"))
    save_file({"y": np.zeros(3, np.float16)}, str(d / "s2.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 22}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}))
    for name in ("m.safetensors", "legacy.pt", "model.safetensors.index.json"):  # imports done before tracing
        _read_all(d / name)
    _read_all(d / "m.h5", isolate=True)
    return d


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_mutated_safetensors(files, tmp_path, data):
    p = tmp_path / "m.safetensors"
    p.write_bytes(_mutate((files / "m.safetensors").read_bytes(), data.draw))
    _check(p, 64 * os.path.getsize(p) + (2 << 20))


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_mutated_legacy_torch(files, tmp_path, data):
    p = tmp_path / "legacy.pt"
    p.write_bytes(_mutate((files / "legacy.pt").read_bytes(), data.draw))
    try:
        _check(p, 64 * os.path.getsize(p) + (2 << 20))
    except (pickle.UnpicklingError, EOFError) as e:  # never: zipslice does not call pickle on file bytes
        pytest.fail(f"pickle itself ran on the file: {e}")


def _hdf5_case(files, tmp_path, data):
    p = tmp_path / "m.h5"
    p.write_bytes(_mutate((files / "m.h5").read_bytes(), data.draw))
    t0 = time.monotonic()
    _check(p, 64 * os.path.getsize(p) + (8 << 20), isolate=True, timeout=5)
    assert time.monotonic() - t0 < 30


# each example starts a child process (~0.3 s): a few in the default run, many under -m slow
@settings(max_examples=12, **SETTINGS)
@given(data=st.data())
def test_mutated_hdf5_in_isolation(files, tmp_path, data):
    _hdf5_case(files, tmp_path, data)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(data=st.data())
def test_many_mutated_hdf5_in_isolation(files, tmp_path, data):
    _hdf5_case(files, tmp_path, data)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_mutated_sharded_index(files, tmp_path, data):
    for name in ("s1.safetensors", "s2.safetensors"):
        (tmp_path / name).write_bytes((files / name).read_bytes())
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(_mutate((files / "model.safetensors.index.json").read_bytes(), data.draw))
    try:
        _check(p, 4 << 20)
    except FileNotFoundError as e:  # a mutated shard name that escapes nothing but does not exist
        pytest.fail(f"not a ZipsliceError: {e}")
    try:
        with zipslice.load(p) as lsd:
            got = {k: lsd.numpy(k) for k in lsd}
    except ZipsliceError:
        return  # refused (and _check saw it name the file)
    # accepted: every tensor is the one its shard holds under that name, as safetensors itself reads it
    weight_map = json.loads(p.read_text())["weight_map"]
    for k, value in got.items():
        want = load_file(str(tmp_path / weight_map[k]))[k]
        assert value.tobytes() == want.tobytes() and value.dtype == want.dtype, k


def test_unmutated_files_read(files):
    for name in ("m.safetensors", "legacy.pt", "model.safetensors.index.json"):
        _read_all(files / name)
    _read_all(files / "m.h5", isolate=True)
