"""A memory cgroup: run commands on "a machine with N bytes of RAM", page cache included.

The one home of this concern for the benchmarks and the tests: the benchmarks import it from this folder, the
tests as ``scripts.bench.memcg`` (tests may use the benchmarks' tools; nothing under scripts/ imports a test).
It is not part of the shipped packages: creating cgroups is the job of whoever measures, never of theta.
Standard library only.

    cg = MemoryCgroup.create("theta-test", 256 << 20)   # raises Unavailable(reason) when it cannot
    subprocess.run(cmd, preexec_fn=cg.join)              # the child and all it starts live in the cgroup
    cg.peak(), cg.oom_kills()
    cg.remove()

    run = cg.child()                                     # a fresh sub-group with the same limit: its own peak
    ...; run.peak(); run.remove()                        # and OOM count, per measured command

The group is made under this process's own memory cgroup when the kernel allows it (so the accounting and
limit of whatever runs the tests still apply), else under the hierarchy's root. cgroup v2 (``memory.max``,
``memory.peak``, ``memory.events``) or v1 (``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``,
``memory.oom_control``). Needs root (or a delegated hierarchy).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_ids = itertools.count()


class Unavailable(Exception):
    """No memory cgroup can be made here; the message says why (for pytest.skip, or a benchmark's note)."""


def _hierarchy() -> tuple[Path, str]:
    """(root of the memory hierarchy, "v1" | "v2"), or Unavailable."""
    v2 = ROOT / "cgroup.controllers"
    if v2.exists() and "memory" in v2.read_text().split():
        return ROOT, "v2"
    if (ROOT / "memory").is_dir():
        return ROOT / "memory", "v1"
    raise Unavailable("no memory cgroup controller (neither cgroup v2 with memory nor v1 memory)")


def _own(base: Path, version: str) -> Path | None:
    """This process's own memory cgroup directory, if it can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if (version == "v2" and controllers == "") or (version == "v1" and "memory" in controllers.split(",")):
            d = base / rel.lstrip("/")
            return d if d.is_dir() else None
    return None


@dataclass
class MemoryCgroup:
    path: Path
    version: str  # "v1" or "v2"
    limit: int

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when memory cgroups can be made here, else why not (without making one)."""
        try:
            _hierarchy()
        except Unavailable as e:
            return str(e)
        if os.geteuid() != 0:
            return "memory cgroups need root here"
        return None

    @classmethod
    def create(cls, name: str, limit: int) -> "MemoryCgroup":
        """A new group named ``name`` (unique per caller: include the pid) limited to ``limit`` bytes."""
        base, version = _hierarchy()
        parents = [p for p in (_own(base, version), base) if p is not None]
        error = None
        for parent in dict.fromkeys(parents):  # own cgroup first, then the root
            try:
                return cls._make(parent / name, version, limit)
            except OSError as e:
                error = e
        raise Unavailable(f"cannot create memory cgroup {name} ({error.strerror}); run as root") from None

    @classmethod
    def _make(cls, path: Path, version: str, limit: int) -> "MemoryCgroup":
        made = not path.exists()
        path.mkdir(exist_ok=True)
        try:
            (path / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(str(limit))
            # no swap: the limit is the machine's RAM (v2 knob; v1's memsw exists only with swap accounting)
            with contextlib.suppress(OSError):
                if version == "v2":
                    (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            if made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        cg = cls(path, version, limit)
        cg.reset_peak()
        return cg

    def child(self, limit: int | None = None) -> "MemoryCgroup":
        """A fresh sub-group (same limit unless given): its own peak and OOM count, e.g. per measured command
        on kernels whose v2 ``memory.peak`` cannot be reset (before Linux 6.12)."""
        if self.version == "v2":
            with contextlib.suppress(OSError):
                (self.path / "cgroup.subtree_control").write_text("+memory")
        return self._make(self.path / f"run{os.getpid()}-{next(_ids)}", self.version,
                          self.limit if limit is None else limit)

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
            pass  # v2 memory.peak is resettable from Linux 6.12 only: use child() for a fresh peak

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for want of memory."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def kill_all(self) -> None:
        """SIGKILL every process still in the group (a command's leftovers after a timeout)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, wait: float = 30.0, kill: bool = False) -> None:
        """Remove the group (and its sub-groups) once its processes are gone (their page cache moves to the
        parent); a process still exiting can hold it for a while: up to ``wait`` seconds, then it is left
        (empty, harmless). ``kill``: SIGKILL what is still inside first."""
        for sub in sorted((p for p in self.path.glob("run*") if p.is_dir()), reverse=True):
            MemoryCgroup(sub, self.version, self.limit).remove(wait, kill)
        deadline = time.monotonic() + wait
        while True:
            if kill:
                self.kill_all()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
