#!/usr/bin/env python3
"""Benchmark: a checkpoint checked out as a view (another format) vs. in its committed format, through real git.

One safetensors checkpoint (default ~256 MiB of float32 groups of 4 MiB, written by safetensors' own library)
is committed with theta. Then, for the committed format (the peer) and for each view format (torch, hdf5),
with the same repository and the same store:

  checkout   rm the file; `git checkout -- model.safetensors` (rebuilds every group, writes the file)
  status     the file's mtime moved; `git status` (git re-cleans the whole file; the tree must be clean)
  add        one group edited with the format's own library; `git add` (one group stored)

Each row prints wall seconds, CPU seconds and the peak RSS of the whole git process tree (psutil, every
20 ms), the median of --rounds rounds (formats alternate order each round), and the ratio view / committed.

    python3 scripts/bench/views.py               # ~256 MiB, 3 rounds
    python3 scripts/bench/views.py --mib 1024    # bigger

Large files go under --workdir (default /tmp/theta-bench-views), never into the repository.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import statistics
import sys
import time
from pathlib import Path

import harness  # scripts/bench/harness.py: this script's folder is first on sys.path

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, mib: int) -> list[str]:
    import safetensors.torch
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(2, mib // 4)
    tensors = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) * 0.02 for i in range(n)}
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return sorted(tensors)


def edit_one(path: Path, fmt: str, name: str, round_no: int) -> None:
    """Change one tensor the way a user of that format's library would."""
    import torch

    if fmt == "safetensors":
        import safetensors.torch

        t = safetensors.torch.load_file(str(path))
        t[name] = t[name] + (round_no + 1)
        safetensors.torch.save_file(t, str(path), metadata={"format": "pt"})
    elif fmt == "torch":
        with open(path, "rb") as f:  # a path ending .safetensors would go to safetensors' loader
            t = torch.load(f, weights_only=True)
        t[name] = t[name] + (round_no + 1)
        torch.save(t, path)
    else:
        import h5py

        with h5py.File(path, "r+") as f:
            f[name][...] = f[name][()] + (round_no + 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench-views"))
    args = ap.parse_args()
    h = harness

    root = args.workdir
    if root.exists():
        shutil.rmtree(root)
    (root / "home").mkdir(parents=True)
    env = h.git_env(root / "home")
    env["PYTHONPATH"] = h.this_checkout_first(env)  # this checkout's theta
    repo = root / "repo"
    h.sh(["git", "init", "-q", str(repo)], root, env)
    for k, v in {"user.name": "bench", "user.email": "bench@example.com"}.items():
        h.sh(["git", "config", k, v], repo, env)
    h.sh(["git", "theta", "install", "--local"], repo, env)
    h.sh(["git", "theta", "track", "*.safetensors"], repo, env)
    model = repo / "model.safetensors"
    names = make_checkpoint(model, args.mib)
    size = model.stat().st_size
    h.sh(["git", "add", ".gitattributes", "model.safetensors"], repo, env)
    h.sh(["git", "commit", "-q", "-m", "v1"], repo, env)
    print(f"checkpoint: {size / MiB:.0f} MiB safetensors, {len(names)} groups; {args.rounds} round(s); "
          f"git {subprocess.run(['git', '--version'], capture_output=True, text=True).stdout.split()[-1]}")

    kinds = ["safetensors", "torch", "hdf5"]
    steps = ["checkout", "status", "add"]
    got: dict[tuple[str, str], list] = {(k, s): [] for k in kinds for s in steps}
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            if kind == "safetensors":
                subprocess.run(["git", "config", "--unset", "theta.checkoutFormat"], cwd=repo, env=env)
            else:
                h.sh(["git", "config", "theta.checkoutFormat", kind], repo, env)
            model.unlink()
            got[(kind, "checkout")].append(h.run_measured(["git", "checkout", "--", "model.safetensors"], repo, env))
            later = time.time() + 5
            os.utime(model, (later, later))
            m = h.run_measured(["git", "status", "--porcelain"], repo, env)
            status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, env=env, capture_output=True,
                                      text=True).stdout.strip()
            if status:
                raise SystemExit(f"{kind}: git status is not clean after checking out the view: {status!r}")
            got[(kind, "status")].append(m)
            edit_one(model, kind, names[r % len(names)], r)
            got[(kind, "add")].append(h.run_measured(["git", "add", "model.safetensors"], repo, env))
            h.sh(["git", "reset", "-q"], repo, env)  # unstage: every round starts from the commit

    def med(kind, step, attr):
        return statistics.median(getattr(m, attr) for m in got[(kind, step)])

    print(f"\n{'step':<9} {'format':<12} {'wall s':>8} {'cpu s':>8} {'peak tree':>10}   "
          f"{'wall x':>7} {'cpu x':>7} {'peak x':>7}   (x = view / committed safetensors)")
    for step in steps:
        base = [med("safetensors", step, a) for a in ("seconds", "cpu", "peak_tree_rss")]
        for kind in kinds:
            t, c, p = (med(kind, step, a) for a in ("seconds", "cpu", "peak_tree_rss"))
            label = kind if kind == "safetensors" else f"{kind} view"
            print(f"{step:<9} {label:<12} {t:>8.2f} {c:>8.2f} {p / MiB:>8.0f} MiB   "
                  f"{t / base[0]:>7.2f} {c / base[1]:>7.2f} {p / base[2]:>7.2f}")
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(on a busy machine trust the cpu columns over wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
