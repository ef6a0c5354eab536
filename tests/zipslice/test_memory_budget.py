"""zipslice.memory: the memory a process really has -- the host's, within its cgroup's limit and usage."""
from __future__ import annotations

import psutil

from zipslice import memory


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_headroom_is_the_tightest_level_and_page_cache_counts_as_free(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/a/b\n")
    fs = tmp_path / "fs"
    write(fs / "a/b/memory.max", "max\n")
    write(fs / "a/memory.max", str(1 << 30))
    write(fs / "a/memory.current", str(900 << 20))
    write(fs / "a/memory.stat", f"anon {500 << 20}\nfile {400 << 20}\n")
    assert memory.cgroup_memory_limit(str(proc), str(fs)) == 1 << 30
    assert memory.cgroup_headroom(str(proc), str(fs)) == (1 << 30) - (500 << 20)
    write(fs / "memory.max", str(600 << 20))  # the root is tighter
    write(fs / "memory.current", str(300 << 20))
    assert memory.cgroup_headroom(str(proc), str(fs)) == 300 << 20


def test_v1_headroom_uses_the_hierarchical_limit_and_total_cache(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "4:memory:/jobs/one\n")
    d = tmp_path / "fs/memory/jobs/one"
    write(d / "memory.stat", f"cache 1\ntotal_cache {100 << 20}\nhierarchical_memory_limit {512 << 20}\n")
    write(d / "memory.usage_in_bytes", str(400 << 20))
    assert memory.cgroup_headroom(str(proc), str(tmp_path / "fs")) == (512 << 20) - (300 << 20)
    write(d / "memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    assert memory.cgroup_headroom(str(proc), str(tmp_path / "fs")) is None  # unlimited


def test_no_cgroup_means_no_limit(tmp_path):
    assert memory.cgroup_headroom(str(tmp_path / "missing"), str(tmp_path)) is None
    assert memory.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None


def test_available_and_total_stay_within_the_machine():
    vm = psutil.virtual_memory()
    assert 0 < memory.available() <= vm.total
    assert 0 < memory.total() <= vm.total


def test_available_reads_linux_meminfo_as_psutil_does(tmp_path):
    """zipslice.memory reads MemAvailable itself (no psutil import at a checkout's start); same number."""
    import sys

    import psutil

    from zipslice import memory

    fake = tmp_path / "meminfo"
    fake.write_bytes(b"MemTotal:       24684396 kB\nMemFree:        20100000 kB\nMemAvailable:   22713804 kB\n")
    assert memory._meminfo_available(str(fake)) == 22713804 * 1024
    fake.write_bytes(b"MemTotal:       24684396 kB\n")  # a kernel without the line: psutil's own estimate
    assert memory._meminfo_available(str(fake)) is None
    assert memory._meminfo_available(str(tmp_path / "missing")) is None
    if sys.platform.startswith("linux"):
        ours, theirs = memory._meminfo_available(), psutil.virtual_memory().available
        assert abs(ours - theirs) < 256 << 20  # two reads of a moving number
