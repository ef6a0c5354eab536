"""A memory cgroup for tests and benchmarks: run commands on "a machine with N bytes of RAM", page cache included.

    cg = MemoryCgroup.create("theta-test", 256 << 20)   # raises Unavailable(reason) when it cannot
    subprocess.run(cmd, preexec_fn=cg.join)              # the child and all it starts live in the cgroup
    cg.peak(), cg.oom_kills()
    cg.remove()

cgroup v2 (``memory.max``, ``memory.peak``, ``memory.events``) or v1 (``memory.limit_in_bytes``,
``memory.max_usage_in_bytes``, ``memory.oom_control``). Needs root (or a delegated hierarchy).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class Unavailable(Exception):
    """No memory cgroup can be made here; the message says why (for pytest.skip)."""


@dataclass
class MemoryCgroup:
    path: Path
    version: str  # "v1" or "v2"
    limit: int

    @classmethod
    def create(cls, name: str, limit: int) -> "MemoryCgroup":
        v2 = ROOT / "cgroup.controllers"
        if v2.exists() and "memory" in v2.read_text().split():
            path, version, knob = ROOT / name, "v2", "memory.max"
        elif (ROOT / "memory").is_dir():
            path, version, knob = ROOT / "memory" / name, "v1", "memory.limit_in_bytes"
        else:
            raise Unavailable("no memory cgroup controller (neither cgroup v2 with memory nor v1 memory)")
        try:
            path.mkdir(exist_ok=True)
            (path / knob).write_text(str(limit))
            if version == "v2":
                try:
                    (path / "memory.swap.max").write_text("0")
                except OSError:
                    pass
        except OSError as e:
            raise Unavailable(f"cannot create memory cgroup {path} ({e.strerror}); run as root") from None
        cg = cls(path, version, limit)
        cg.reset_peak()
        return cg

    def join(self) -> None:
        """preexec_fn: move the calling (child) process into this cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def usage(self) -> int:
        return int(self._read("memory.current" if self.version == "v2" else "memory.usage_in_bytes"))

    def peak(self) -> int:
        """Highest memory use (page cache included) since creation or :meth:`reset_peak`."""
        if self.version == "v1":
            return int(self._read("memory.max_usage_in_bytes"))
        try:
            return int(self._read("memory.peak"))
        except FileNotFoundError:  # kernels before 5.19 have no memory.peak
            return self.usage()

    def reset_peak(self) -> None:
        try:
            (self.path / ("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak")).write_text("0")
        except OSError:
            pass  # v2 memory.peak is resettable from Linux 6.12 only

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for want of memory."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (their page cache is moved to the parent); a
        process still exiting can hold it for a while: up to 30 s, then it is left (empty, harmless)."""
        for _ in range(300):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
