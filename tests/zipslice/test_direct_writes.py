"""A file written past what the page cache can keep goes around it (O_DIRECT windows), byte for byte the
file the page cache would have written: appends of any size, patches behind and inside the window, reads
and flushes between writes, and file systems that refuse direct writes."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random

import pytest
from test_pagecache import resident_fraction

from zipslice import fileio
from zipslice.fileio import WriteBehindFile, _DirectWindows

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs O_DIRECT")
WINDOW = 1 << 20


def _write_like_a_writer(out, rng: random.Random, total: int) -> bytearray:
    """Appends of sizes from 1 byte to 2.5 windows, a patch now and then (a CRC behind, a field in the
    window), an attribute asked of the file; returns what the file must hold."""
    model = bytearray()
    while len(model) < total:
        n = rng.choice([1, 7, 4096, 4099, WINDOW - 3, WINDOW, 5 * WINDOW // 2, rng.randrange(1, 3 * WINDOW)])
        data = rng.randbytes(n)
        out.write(data)
        model += data
        assert out.tell() == len(model)
        if rng.random() < 0.3:
            at = rng.randrange(len(model))
            patch = rng.randbytes(min(rng.choice([1, 4, 5000]), len(model) - at))
            out.seek(at)
            out.write(patch)
            model[at:at + len(patch)] = patch
            assert out.seek(0, os.SEEK_END) == len(model)
        if rng.random() < 0.1:
            assert out.fileno() > 0  # anything else asked of the file: it holds every byte first
            assert os.fstat(out.fileno()).st_size == len(model)
    return model


@pytest.mark.parametrize("seed", range(6))
def test_direct_windows_write_the_bytes_the_page_cache_would(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "out.bin"
    start = rng.choice([0, 3 * WINDOW + 5, 4 * WINDOW])
    with open(path, "wb") as f, WriteBehindFile(f, direct_after=start, window=WINDOW) as out:
        model = _write_like_a_writer(out, rng, 24 * WINDOW)
        assert out._first_direct >= start and out._direct.start >= out._first_direct + 8 * WINDOW
        assert out._direct.direct_fd is not None
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(model).digest()


def test_direct_windows_leave_nothing_in_the_page_cache(tmp_path):
    path = tmp_path / "out.bin"
    data = os.urandom(40 * WINDOW + 123)
    with open(path, "wb") as f, WriteBehindFile(f, direct_after=4 * WINDOW, window=WINDOW) as out:
        for i in range(0, len(data), 3 * WINDOW // 2):
            out.write(data[i:i + 3 * WINDOW // 2])
        direct_from, written = out._first_direct, out._direct.start
        assert 4 * WINDOW <= direct_from < written - 20 * WINDOW
        assert resident_fraction(path, direct_from, written - direct_from) == 0.0
        assert resident_fraction(path, 0, 2 * WINDOW) > 0.0  # what went through the cache stayed there
    assert path.read_bytes() == data


def test_the_cache_budget_decides_when_to_write_direct(tmp_path, monkeypatch):
    from zipslice import pagecache
    monkeypatch.setattr(pagecache, "cache_budget", lambda: 8 * WINDOW)  # too big to cache from 4 windows on
    path = tmp_path / "out.bin"
    data = os.urandom(16 * WINDOW)
    with open(path, "wb") as f, WriteBehindFile(f, window=WINDOW) as out:
        out.write(data)
        assert out._direct is not None and 4 * WINDOW < out._first_direct <= 6 * WINDOW
    assert path.read_bytes() == data


def test_a_file_system_refusing_direct_writes_gets_the_page_cache(tmp_path, monkeypatch):
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "direct writes refused here")
        return real(fd, data, offset)

    monkeypatch.setattr(fileio.os, "pwrite", pwrite)
    rng = random.Random(7)
    path = tmp_path / "out.bin"
    with open(path, "wb") as f, WriteBehindFile(f, direct_after=WINDOW, window=WINDOW) as out:
        model = _write_like_a_writer(out, rng, 12 * WINDOW)
    assert refused and path.read_bytes() == model


def test_a_file_system_refusing_o_direct_at_open_gets_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(_DirectWindows, "open", classmethod(lambda cls, fd, start, window: None))
    rng = random.Random(8)
    path = tmp_path / "out.bin"
    with open(path, "wb") as f, WriteBehindFile(f, direct_after=WINDOW, window=WINDOW) as out:
        model = _write_like_a_writer(out, rng, 6 * WINDOW)
        assert out._direct is None
    assert path.read_bytes() == model


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_checkpoint_written_past_the_cache_budget_reads_back_bit_for_bit(tmp_path, monkeypatch, fmt):
    import numpy as np
    import torch

    import zipslice
    from zipslice import pagecache
    monkeypatch.setattr(pagecache, "cache_budget", lambda: 16 << 20)  # too big to cache past 8 MiB
    direct = []
    real = _DirectWindows._write_window
    monkeypatch.setattr(_DirectWindows, "_write_window", lambda self: (direct.append(self.direct_fd), real(self)))
    gen = torch.Generator().manual_seed(3)
    state = {"embed": torch.randn(3001, 1024, generator=gen).to(torch.bfloat16),
             "w": torch.randn(8199, 1031, generator=gen), "b": torch.randn(7, generator=gen)}
    path = tmp_path / f"m.{'pt' if fmt == 'torch' else 'safetensors'}"
    zipslice.save(path, state, format=fmt)
    assert len(direct) >= 2 and None not in direct
    back = zipslice.load(path)
    for k, v in state.items():
        assert np.array_equal(back[k].view(torch.uint8 if v.dtype == torch.bfloat16 else v.dtype).numpy(),
                              v.view(torch.uint8 if v.dtype == torch.bfloat16 else v.dtype).numpy())
    if fmt == "torch":
        assert all(torch.equal(torch.load(path)[k].view(torch.int16 if v.dtype == torch.bfloat16 else v.dtype),
                               v.view(torch.int16 if v.dtype == torch.bfloat16 else v.dtype)) for k, v in state.items())
