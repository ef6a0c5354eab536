"""How much memory this process really has: the host's, within the limit of its memory cgroup.

``psutil.virtual_memory()`` reports the host. A container or a systemd/cgroup job (v1
``memory.limit_in_bytes``, v2 ``memory.max``) may allow far less, and the kernel kills a process that goes
over it however much the host has free. Every decision "does this fit in memory?" in zipslice and theta asks
this module: :mod:`zipslice.pagecache` (drop-behind reads) and theta's checkout (whether git may be handed a
whole checkpoint, which git holds in memory while it writes the file).

The cgroup files are read from ``/proc/self/cgroup`` and ``/sys/fs/cgroup``; page cache counts toward a
cgroup's usage but the kernel reclaims it under pressure, so "headroom" subtracts only what is not cache.
"""
from __future__ import annotations

import os

# cgroup v1 reports "no limit" as a huge number (2**63 rounded down to a page)
_NO_LIMIT = 1 << 60


def _memory_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """("v1", path) or ("v2", path) of this process's memory cgroup, from /proc/self/cgroup."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return "v1", path
    for line in lines:
        if line.startswith("0::"):
            return "v2", line[3:]
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) is no limit


def _read_stat(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def _v1_dirs(root: str, path: str) -> list[str]:
    # inside a container the path names the host's hierarchy while root/memory is already the container's own
    base = os.path.join(root, "memory")
    return [os.path.join(base, path.lstrip("/")), base]


def _v1_limit(root: str, path: str) -> int | None:
    for d in _v1_dirs(root, path):
        stat = _read_stat(os.path.join(d, "memory.stat"))
        if "hierarchical_memory_limit" in stat:  # already covers the ancestors
            limit = stat["hierarchical_memory_limit"]
            return limit if limit < _NO_LIMIT else None
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        if limit is not None:
            return limit if limit < _NO_LIMIT else None
    return None


def _v1_headroom(root: str, path: str) -> int | None:
    limit = _v1_limit(root, path)
    if limit is None:
        return None
    for d in _v1_dirs(root, path):
        usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
        if usage is not None:
            stat = _read_stat(os.path.join(d, "memory.stat"))
            cache = stat.get("total_cache", stat.get("cache", 0))
            return max(0, limit - max(0, usage - cache))
    return limit


def _v2_levels(root: str, path: str):
    """Each cgroup directory from this process's up to the root."""
    d = os.path.join(root, path.lstrip("/"))
    while True:
        yield d
        if os.path.normpath(d) == os.path.normpath(root):
            return
        d = os.path.dirname(d)


def _v2_limit(root: str, path: str) -> int | None:
    limits = [x for d in _v2_levels(root, path) if (x := _read_int(os.path.join(d, "memory.max"))) is not None]
    return min(limits) if limits else None


def _v2_headroom(root: str, path: str) -> int | None:
    rooms = []
    for d in _v2_levels(root, path):
        limit = _read_int(os.path.join(d, "memory.max"))
        if limit is None:
            continue
        current = _read_int(os.path.join(d, "memory.current")) or 0
        cache = _read_stat(os.path.join(d, "memory.stat")).get("file", 0)
        rooms.append(max(0, limit - max(0, current - cache)))
    return min(rooms) if rooms else None


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup and its ancestors (page cache included), or None."""
    found = _memory_cgroup(proc_cgroup)
    if found is None:
        return None
    kind, path = found
    return _v1_limit(root, path) if kind == "v1" else _v2_limit(root, path)


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup can still allocate before its limit (cache counts as free), or None."""
    found = _memory_cgroup(proc_cgroup)
    if found is None:
        return None
    kind, path = found
    return _v1_headroom(root, path) if kind == "v1" else _v2_headroom(root, path)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's own estimate of available memory (``MemAvailable``, what psutil reports there), read without
    importing psutil (~12 ms of a checkout's start-up); None where the file or the line is missing."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    fields = line.split()
                    return int(fields[1]) * (1024 if fields[2:3] == [b"kB"] else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_available() -> int:
    """The host's available memory in bytes (``MemAvailable`` from /proc, psutil where that is missing)."""
    host = _meminfo_available()
    if host is None:
        import psutil

        host = psutil.virtual_memory().available
    return host


def available() -> int:
    """Bytes a new allocation can count on now: the host's available memory, within the cgroup's headroom."""
    host = host_available()
    room = cgroup_headroom()
    return host if room is None else min(host, room)


def total() -> int:
    """The memory this process may ever use: the host's RAM, or its cgroup limit when that is smaller."""
    import psutil

    host = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    return host if limit is None else min(host, limit)
