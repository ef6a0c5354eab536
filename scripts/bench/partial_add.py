#!/usr/bin/env python3
"""The 20% add of scripts/bench/git.py alone (or its full fine-tune, --step fine-tune, or its 50%-pruned add,
--step pruned), for one or more checkouts of theta side by side (an A/B of code).

One repository holds v1 of the issue's history (make_history), v2 for the fine-tune, and v4 then the grown
version for the pruned add; each round then adds v2 (every 5th group changed), v3 (every group fine-tuned) or
the pruned version once per checkout, interleaved so a drifting load hits them all alike, and resets the
index. Each `git add` runs the filter from that checkout (PYTHONPATH), from cached bytecode. Printed per
checkout: wall and CPU seconds of the process tree (min and median over the rounds) and the peak RSS.

    python3 scripts/bench/partial_add.py --code /path/to/main,/path/to/branch --rounds 8

A checkout may carry environment variables after ``@`` (``path@NAME=value@NAME=value``), e.g. one worker
thread against the default: ``--code .,.@GIT_THETA_THREADS=1``.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from git import install_globally, make_chain_versions, make_history, settle  # noqa: E402  (scripts/bench/git.py)
from harness import git_env, new_repo, run_measured, sh, variant_env  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", required=True, help="comma-separated checkouts of this project to compare, each "
                    "optionally followed by @NAME=value environment variables")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", default="2", help="GIT_THETA_THREADS")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--step", choices=("20%", "fine-tune", "pruned"), default="20%")
    args = ap.parse_args()
    variants = {c: variant_env(c) for c in args.code.split(",")}
    codes = list(variants)
    root = args.workdir / f"partial-add-{args.step}"
    root.mkdir(parents=True, exist_ok=True)
    env = git_env(root / "home")
    install_globally(env)
    paths, _ = make_history(args.workdir / "data", 1.0)
    env = {**env, "GIT_THETA_THREADS": args.threads}
    repo = new_repo(root, "repo", "theta", {**env, **variants[codes[0]]})
    shutil.copyfile(paths[0], repo / "model.pt")
    first = {**env, **variants[codes[0]]}
    sh(["git", "add", "model.pt"], repo, first)
    sh(["git", "commit", "-q", "-m", "v1"], repo, first)
    added = paths[1]
    if args.step == "fine-tune":
        shutil.copyfile(paths[1], repo / "model.pt")
        sh(["git", "add", "model.pt"], repo, first)
        sh(["git", "commit", "-q", "-m", "v2"], repo, first)
        added = paths[2]
    elif args.step == "pruned":  # git.py's "50% pruned: add": from the grown fine-tune of v4 (a chained embedding)
        chain = make_chain_versions(args.workdir / "data", 1.0)
        for label, version in (("v4", paths[3]), ("grow", chain["grow"])):
            shutil.copyfile(version, repo / "model.pt")
            sh(["git", "add", "model.pt"], repo, first)
            sh(["git", "commit", "-q", "-m", label], repo, first)
        added = chain["pruned"]
    got: dict[str, list] = {c: [] for c in codes}
    for r in range(args.rounds):
        for c in codes:
            run_env = {**env, **variants[c]}
            shutil.copyfile(added, repo / "model.pt")
            settle(repo, run_env)
            got[c].append(run_measured(["git", "add", "model.pt"], repo, run_env))
            sh(["git", "reset", "-q"], repo, run_env)
    for c, ms in got.items():
        wall = [m.seconds for m in ms]
        cpu = [m.cpu for m in ms]
        print(f"{c}: wall min {min(wall):.2f} median {statistics.median(wall):.2f} s, CPU min {min(cpu):.2f} "
              f"median {statistics.median(cpu):.2f} s, peak RSS {max(m.peak_tree_rss for m in ms) / 2**20:.0f} MiB "
              f"({len(ms)} rounds)")
        print(f"    wall per round: {' '.join(f'{w:.2f}' for w in wall)}; CPU: {' '.join(f'{x:.2f}' for x in cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
