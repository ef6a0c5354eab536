"""Run a command under a time limit and, where the machine allows it, a memory cap.

    res = run_limited(["git", "clone", url, dest], cwd=home, env=genv.env, timeout=60, memory=1 << 30)
    res.returncode, res.stderr, res.timed_out, res.peak_bytes, res.capped

The memory cap is a memory cgroup (scripts.bench.memcg: v2, else v1, under this process's own cgroup where the
kernel allows it), which the command joins before it starts: it covers
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
from typing import Iterator

from scripts.bench.memcg import MemoryCgroup, Unavailable


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


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup | None]:
    """A fresh memory cgroup of ``limit`` bytes (scripts.bench.memcg), removed afterwards with anything left in
    it; None if this machine cannot make one."""
    try:
        cg = MemoryCgroup.create(f"theta-test-{uuid.uuid4().hex[:12]}", limit)
    except Unavailable:
        yield None
        return
    try:
        yield cg
    finally:
        cg.remove(wait=5.0, kill=True)  # the processes may take a moment to leave


def run_limited(args: list[str], cwd, env: dict, timeout: float, memory: int | None = None,
                input: bytes | None = None) -> Limited:
    """Run ``args`` in its own session, killed after ``timeout`` seconds, within ``memory`` bytes if possible."""
    with (memory_cgroup(memory) if memory else contextlib.nullcontext(None)) as cg:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.PIPE if input is not None else None,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=cg.join if cg is not None else None)
        timed_out = False
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if cg is not None:
                cg.kill_all()
            out, err = proc.communicate()
        seconds = time.monotonic() - t0
        # nothing of the command may outlive it (a filter left running would hold the repository)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        peak, oom = (cg.peak(), cg.oom_kills() > 0) if cg is not None else (None, False)
    return Limited(proc.returncode, out, err, seconds, timed_out, cg is not None, peak, oom)
