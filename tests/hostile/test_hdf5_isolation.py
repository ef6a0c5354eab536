"""zipslice.load(path, isolate=True): libhdf5 parses the file in a child process with a time limit, so a
file that hangs or crashes the library becomes a clear error instead of taking the caller (git's filter)
down. The isolated reader must give exactly what the in-process reader gives."""
from __future__ import annotations

import os
import signal
import time

import h5py
import ml_dtypes
import numpy as np
import pytest

import zipslice
from zipslice.errors import CorruptCheckpointError, ZipsliceError
from zipslice.hdf5_isolated import IsolatedHDF5Checkpoint

from support import FIXTURES
from support.crafted import limited_git
from support.gitrepo import GitEnv

HOSTILE = FIXTURES / "hdf5"


def _sample(path):
    with h5py.File(path, "w", track_order=True) as f:
        f["plain"] = np.arange(12, dtype=np.float32).reshape(3, 4)
        f.create_dataset("g/chunked", data=np.arange(1000, dtype=np.int64), chunks=(100,), compression="gzip")
        f.create_dataset("g/big_endian", data=np.arange(6, dtype=">f8"))
        f["g"].attrs["note"] = "x"
        f["text"] = "hello"
        f["numbers"] = np.array([1 + 2j, 3j])
        f.attrs["format"] = "test"
    return path


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a.info(k) == b.info(k)
        x, y = a.numpy(k, raw=True), b.numpy(k, raw=True)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
    assert a.metadata == b.metadata and a.skipped == b.skipped and a.layout == b.layout
    assert a.hdf5_paths == b.hdf5_paths
    assert set(a.extras) == set(b.extras)
    for k in a.extras:
        assert repr(a.extras[k]) == repr(b.extras[k]), k


def test_isolated_reader_matches_the_in_process_one(tmp_path):
    p = _sample(tmp_path / "m.h5")
    with zipslice.load(p) as plain, zipslice.load(p, isolate=True) as iso:
        assert isinstance(iso, IsolatedHDF5Checkpoint) and iso.format == "hdf5"
        _same(plain, iso)
        assert iso.info("plain").offset is not None  # read by the parent: no HDF5 code
        assert iso.info("g/chunked").offset is None  # read by the child


def test_isolated_reader_handles_bfloat16_and_keras_names(tmp_path):
    from zipslice import TensorSource
    from zipslice.hdf5_format import write

    bf = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    p = tmp_path / "k.h5"
    write(p, [TensorSource("dense/kernel", "bfloat16", (8,), read=lambda: bf.tobytes())])
    with zipslice.load(p) as plain, zipslice.load(p, isolate=True) as iso:
        _same(plain, iso)
        assert iso.info("dense/kernel").dtype == "bfloat16"


def test_other_formats_are_unaffected_by_isolate(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"))
    with zipslice.load(tmp_path / "m.safetensors", isolate=True) as lsd:
        assert lsd.format == "safetensors" and lsd.numpy("w").tolist() == [1, 1, 1]


def _child_pid(lsd: IsolatedHDF5Checkpoint) -> int:
    return lsd._proc.pid


def test_a_crash_of_the_library_is_a_clear_error(tmp_path):
    """The child is killed by SIGSEGV (what libhdf5 does on some files) before a read: the caller gets an
    error naming the file and the signal, and goes on living."""
    p = _sample(tmp_path / "m.h5")
    lsd = zipslice.load(p, isolate=True)
    pid = _child_pid(lsd)
    os.kill(pid, signal.SIGSEGV)
    with pytest.raises(CorruptCheckpointError) as e:
        lsd.numpy("g/chunked")
    assert str(p) in str(e.value) and "SIGSEGV" in str(e.value) and "separate process" in str(e.value)
    assert lsd.numpy("plain").sum() == 66  # addressable tensors never needed the child
    lsd.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_hang_is_stopped_at_the_time_limit(tmp_path):
    p = _sample(tmp_path / "m.h5")
    lsd = zipslice.load(p, isolate=True, timeout=1.0)
    pid = _child_pid(lsd)
    os.kill(pid, signal.SIGSTOP)  # the library "hangs"
    t0 = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="did not finish within 1 s"):
        lsd.numpy("g/chunked")
    assert time.monotonic() - t0 < 10
    with pytest.raises(ProcessLookupError):  # the child was killed, not left behind
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.05)
    lsd.close()


def test_errors_inside_the_child_keep_their_class_and_entry(tmp_path):
    p = tmp_path / "bad.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("w", data=np.zeros(4, np.uint32))
        d.attrs["zipslice_dtype"] = "bfloat16"  # 4-byte carrier for a 2-byte dtype: refused
    with pytest.raises(CorruptCheckpointError) as e:
        zipslice.load(p, isolate=True)
    assert e.value.path == str(p) and e.value.entry == "w" and "marked as 'bfloat16'" in str(e.value)


def _hostile_fixtures():
    return sorted(HOSTILE.glob("*.h5")) if HOSTILE.exists() else []


@pytest.mark.parametrize("path", _hostile_fixtures(), ids=lambda p: p.name)
def test_files_that_hang_or_crash_libhdf5_give_a_clean_error(path):
    t0 = time.monotonic()
    try:
        with zipslice.load(path, isolate=True, timeout=5) as lsd:
            for k in lsd:
                lsd.numpy(k, raw=True)
    except ZipsliceError as e:
        assert e.path == str(path)
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
@pytest.mark.parametrize("path", _hostile_fixtures()[:1], ids=lambda p: p.name)
def test_git_add_of_a_hanging_hdf5_file_fails_cleanly(tmp_path, path):
    genv = GitEnv.create(tmp_path)
    repo = genv.init("work", track=("*.h5",))
    (repo / "model.h5").write_bytes(path.read_bytes())
    res = limited_git(repo, "add", "model.h5", timeout=120, extra_env={"GIT_THETA_ISOLATE_TIMEOUT": "5"})
    assert not res.timed_out and "Traceback" not in res.err
    if h5py.version.version.startswith("3.16") or res.returncode != 0:  # the libhdf5 the case was recorded with
        assert res.returncode != 0
        assert "model.h5" in res.err and "did not finish within 5 s" in res.err, res.err
        assert repo.out("ls-files") == ""
