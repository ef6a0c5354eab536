"""Drop-behind: a checkpoint too big to stay cached lets go of each span's pages once read.

Residency is asked of the kernel itself (mincore on a read-only mapping of the file, which maps nothing
by itself), so these tests see what the page cache really holds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np
import pytest
import torch

import zipslice
from zipslice import pagecache

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")


def resident_fraction(path, offset: int, nbytes: int) -> float:
    """Fraction of the pages fully inside [offset, offset + nbytes) that are in the page cache."""
    first = -(-offset // PAGE) * PAGE
    last = (offset + nbytes) // PAGE * PAGE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data + first
        n = (last - first) // PAGE
        vec = (ctypes.c_ubyte * n)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(last - first), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) / n


def warm(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages are not dropped; a freshly written file must reach the disk first
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)


@pytest.fixture
def droppable(tmp_path):
    """tmpfs and the like keep file pages whatever they are told: nothing to test there."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * (1 << 20))
    warm(probe)
    fd = os.open(probe, os.O_RDONLY)
    pagecache.drop(fd, 0, 1 << 20)
    os.close(fd)
    if resident_fraction(probe, 0, 1 << 20) > 0.5:
        pytest.skip(f"the file system under {tmp_path} keeps pages after POSIX_FADV_DONTNEED")


@pytest.fixture
def torch_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"a": torch.arange(4 << 20, dtype=torch.float32), "b": torch.ones(3, 5)}, path)
    warm(path)
    return path


@pytest.mark.parametrize("drop", [True, False])
def test_torch_reader_drops_what_it_read_only_when_asked(droppable, torch_file, drop):
    with zipslice.load(torch_file, drop_behind=drop) as lsd:
        info = lsd.info("a")
        assert resident_fraction(torch_file, info.offset, info.span_nbytes) == 1.0
        t = lsd["a"]
        assert torch.equal(t, torch.arange(4 << 20, dtype=torch.float32))  # the values were read first
        left = resident_fraction(torch_file, info.offset, info.span_nbytes)
    # the kernel keeps a (large) folio that reaches outside the span: here at most the ones at its ends
    assert (left <= 0.25) if drop else (left == 1.0)


def test_safetensors_reader_drops_too(droppable, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    want = torch.randn(1 << 20)
    save_file({"w": want}, str(path))
    warm(path)
    with zipslice.load(path, drop_behind=True) as lsd:
        info = lsd.info("w")
        assert torch.equal(lsd["w"], want)
        assert resident_fraction(path, info.offset, info.span_nbytes) <= 0.25


def test_automatic_choice_follows_the_size(droppable, torch_file, monkeypatch):
    size = os.path.getsize(torch_file)
    with zipslice.load(torch_file) as lsd:
        assert lsd.data_file_bytes() == size
        monkeypatch.setattr(pagecache, "cache_budget", lambda: 2 * size + 2)
        assert not lsd.dropping_behind()  # fits in half of what can be cached: keep it
    with zipslice.load(torch_file) as lsd:
        monkeypatch.setattr(pagecache, "cache_budget", lambda: 2 * size - 2)
        assert lsd.dropping_behind()
        info = lsd.info("a")
        lsd["a"]
        assert resident_fraction(torch_file, info.offset, info.span_nbytes) <= 0.25


def test_threshold_is_half_the_budget():
    assert not pagecache.too_big_to_cache(50, budget=100)
    assert pagecache.too_big_to_cache(51, budget=100)


def test_budget_is_positive_and_within_the_machine():
    import psutil

    assert 0 < pagecache.cache_budget() <= psutil.virtual_memory().total


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_read_from_the_hierarchy(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "9:cpu,cpuacct:/x\n4:memory:/jobs/one\n0::/\n")
    write(tmp_path / "fs/memory/jobs/one/memory.stat", "cache 1\nhierarchical_memory_limit 4294967296\n")
    assert pagecache.cgroup_memory_limit(str(proc), str(tmp_path / "fs")) == 4 << 30
    write(tmp_path / "fs/memory/jobs/one/memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    assert pagecache.cgroup_memory_limit(str(proc), str(tmp_path / "fs")) is None  # v1's "unlimited"


def test_cgroup_v1_inside_a_container_reads_its_own_root(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "4:memory:/docker/abc\n")  # the host's path; the container sees its own cgroup at the root
    write(tmp_path / "fs/memory/memory.limit_in_bytes", "2147483648\n")
    assert pagecache.cgroup_memory_limit(str(proc), str(tmp_path / "fs")) == 2 << 30


def test_cgroup_v2_takes_the_smallest_limit_up_the_tree(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/a/b\n")
    write(tmp_path / "fs/memory.max", "max\n")
    write(tmp_path / "fs/a/memory.max", "1073741824\n")
    write(tmp_path / "fs/a/b/memory.max", "max\n")
    assert pagecache.cgroup_memory_limit(str(proc), str(tmp_path / "fs")) == 1 << 30
    write(tmp_path / "fs/a/memory.max", "max\n")
    assert pagecache.cgroup_memory_limit(str(proc), str(tmp_path / "fs")) is None
    assert pagecache.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path / "fs")) is None
