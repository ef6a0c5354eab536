"""Run a command under a time limit and, where the machine allows it, a memory cap.

    res = run_limited(["git", "clone", url, dest], cwd=home, env=genv.env, timeout=60, memory=1 << 30)
    res.returncode, res.stderr, res.timed_out, res.peak_bytes, res.capped

The memory cap is a memory cgroup (v2, else v1) created *under this process's own cgroup* (so the
accounting of whatever runs the tests is untouched), which the command joins before it starts: it covers
the whole process tree (git, the filter, git-lfs). Without root or a memory controller the command runs
uncapped (``res.capped`` is False) and only the time limit applies. On timeout every process of the
command's session is killed (git's filter too, not just git).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass
class Limited:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    seconds: float
    timed_out: bool
    capped: bool                 # a memory cap was in force
    peak_bytes: int | None       # the cgroup's peak memory, when capped
    oom_killed: bool             # the cap was hit (the kernel killed something)

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")


def _own_cgroup() -> tuple[str, str] | None:
    """(directory of this process's memory cgroup, "v1"|"v2"), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            d = "/sys/fs/cgroup" + rel
            if "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
                return d, "v2"
        if "memory" in controllers.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
            return "/sys/fs/cgroup/memory" + rel, "v1"
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, str] | None]:
    """A fresh memory cgroup of ``limit`` bytes under our own, removed afterwards; None if not possible."""
    own = _own_cgroup()
    if own is None or os.geteuid() != 0:
        yield None
        return
    parent, version = own
    path = os.path.join(parent, f"theta-test-{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(path)
        knob = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        with open(os.path.join(path, knob), "w") as f:
            f.write(str(limit))
        if version == "v2":
            with contextlib.suppress(OSError), open(os.path.join(path, "memory.swap.max"), "w") as f:
                f.write("0")
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        yield None
        return
    try:
        yield path, version
    finally:
        for _ in range(50):  # the processes may take a moment to leave
            try:
                os.rmdir(path)
                break
            except OSError:
                _kill_cgroup(path)
                time.sleep(0.1)


def _kill_cgroup(path: str) -> None:
    with contextlib.suppress(OSError):
        for pid in Path(path, "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _peak(path: str, version: str) -> tuple[int | None, bool]:
    try:
        if version == "v2":
            peak_file = Path(path, "memory.peak")
            peak = int(peak_file.read_text()) if peak_file.exists() else None
            events = dict(line.split() for line in Path(path, "memory.events").read_text().splitlines())
            return peak, int(events.get("oom_kill", 0)) > 0
        peak = int(Path(path, "memory.max_usage_in_bytes").read_text())
        failcnt = int(Path(path, "memory.failcnt").read_text())
        oom = "oom_kill 1" in Path(path, "memory.oom_control").read_text() or failcnt > 0 and _oom_v1(path)
        return peak, oom
    except (OSError, ValueError):
        return None, False


def _oom_v1(path: str) -> bool:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(path, "memory.oom_control").read_text().splitlines():
            k, v = line.split()
            if k == "oom_kill" and int(v) > 0:
                return True
    return False


def run_limited(args: list[str], cwd, env: dict, timeout: float, memory: int | None = None,
                input: bytes | None = None) -> Limited:
    """Run ``args`` in its own session, killed after ``timeout`` seconds, within ``memory`` bytes if possible."""
    with (memory_cgroup(memory) if memory else contextlib.nullcontext(None)) as cg:
        def join() -> None:
            if cg is not None:
                with open(os.path.join(cg[0], "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.PIPE if input is not None else None,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=join if cg is not None else None)
        timed_out = False
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if cg is not None:
                _kill_cgroup(cg[0])
            out, err = proc.communicate()
        seconds = time.monotonic() - t0
        # nothing of the command may outlive it (a filter left running would hold the repository)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        peak, oom = _peak(*cg) if cg is not None else (None, False)
    return Limited(proc.returncode, out, err, seconds, timed_out, cg is not None, peak, oom)
