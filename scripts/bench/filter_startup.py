#!/usr/bin/env python3
"""What git waits for before it sends a byte: each tool's long-running filter process, started in a repository
tracking ``*.pt``, answering git's handshake (version and capabilities) and reading the end of its input --
theta's `git-theta filter-process` beside `git-lfs filter-process`, side by side.

For each: wall time, CPU seconds and peak RSS of the process tree (scripts/bench/harness.run_measured), the
lowest and the median of --runs starts, alternating the two tools so a drifting load hits both; the git
processes theta's filter starts (counted with strace -f when it is installed); the load average.

Then the other start a checkout pays: the post-checkout hook, as git runs it after `git checkout` (the script
in .git/hooks with git's three arguments), with a checkout's ledger of placeholders to take but nothing in it
to write -- theta's hook starting `git-theta post-checkout`, beside git-lfs's post-checkout hook.

    python3 scripts/bench/filter_startup.py              # 10 starts of each
    python3 scripts/bench/filter_startup.py --runs 30
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Measure, git_env, new_repo, run_measured

HANDSHAKE = b"0016git-filter-client\n000eversion=2\n0000" b"0015capability=clean\n0016capability=smudge\n0000"


def start(cmd: list[str], repo: Path, env: dict, script: Path) -> Measure:
    with open(script, "rb") as stdin:
        m = run_measured(cmd, repo, env, stdin=stdin, check=False)
    if m.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({m.returncode}):\n{m.stderr}")
    return m


def hook_start(repo: Path, env: dict, ledger: Path | None) -> Measure:
    """One run of ``repo``'s post-checkout hook as git runs it after a checkout (previous and new commit, 1 for
    a branch checkout); ``ledger``: a placeholder ledger to leave first (theta's hook starts git-theta only
    when a checkout handed placeholders out; an empty one makes it start and find nothing to write)."""
    if ledger is not None:
        ledger.parent.mkdir(parents=True, exist_ok=True)
        ledger.write_bytes(b"")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    m = run_measured([str(repo / ".git" / "hooks" / "post-checkout"), head, head, "1"], repo, env, check=False)
    if m.returncode != 0:
        raise SystemExit(f"the post-checkout hook of {repo} failed ({m.returncode}):\n{m.stderr}")
    return m


def table(title: str, results: "dict[str, list[Measure]]", extra: "dict[str, str] | None" = None) -> None:
    print(title)
    print(f"{'tool':<8} {'wall min':>9} {'wall median':>12} {'CPU min':>8} {'CPU median':>11} {'peak RSS':>9}"
          + (f" {'git processes':>14}" if extra else ""))
    for name, runs in results.items():
        walls, cpus = [m.seconds for m in runs], [m.cpu for m in runs]
        print(f"{name:<8} {min(walls):8.3f}s {statistics.median(walls):11.3f}s {min(cpus):7.3f}s "
              f"{statistics.median(cpus):10.3f}s {max(m.peak_tree_rss for m in runs) / 2**20:7.0f} MiB"
              + (f" {extra[name]:>14}" if extra else ""))
    lfs, theta = (min(m.seconds for m in results[k]) for k in ("git-lfs", "theta"))
    print(f"ratio theta / git-lfs (wall min): {theta / lfs:.2f}x")


def git_processes(cmd: list[str], repo: Path, env: dict, script: Path) -> int | None:
    """How many git processes one start of ``cmd`` runs (strace -f), or None without strace."""
    if shutil.which("strace") is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".strace") as log, open(script, "rb") as stdin:
        subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve", "-o", log.name, *cmd], cwd=repo, env=env,
                       stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lines = Path(log.name).read_text().splitlines()
    return sum(1 for line in lines if "execve(" in line and "= 0" in line and '["git"' in line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="starts of each filter (default 10)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench-startup"))
    args = ap.parse_args()
    root = args.workdir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = git_env(root / "home", pythonpath=True)  # measure this checkout's code
    script = root / "handshake.pkt"
    script.write_bytes(HANDSHAKE)
    tools = {"git-lfs": (new_repo(root, "lfs", "lfs", env), ["git-lfs", "filter-process"]),
             "theta": (new_repo(root, "theta", "theta", env), ["git-theta", "filter-process"])}
    results: dict[str, list[Measure]] = {name: [] for name in tools}
    for _ in range(args.runs):
        for name, (repo, cmd) in tools.items():
            results[name].append(start(cmd, repo, env, script))
    hooks: dict[str, list[Measure]] = {name: [] for name in tools}
    for _ in range(args.runs):
        for name, (repo, _cmd) in tools.items():
            ledger = repo / ".git" / "theta" / "handed-0" if name == "theta" else None
            hooks[name].append(hook_start(repo, env, ledger))
    la = os.getloadavg()
    print(f"{args.runs} starts each; load average {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} on {os.cpu_count()} cores")
    counts = {}
    for name, (repo, cmd) in tools.items():
        n = git_processes(cmd, repo, env, script)
        counts[name] = "?" if n is None else str(n)
    table("filter start -> handshake -> end of input", results, counts)
    table("\npost-checkout hook, as git runs it after a checkout (nothing to write)", hooks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
