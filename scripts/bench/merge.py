#!/usr/bin/env python3
"""Benchmark: merging two fine-tunes of a ~300 MiB model through `git merge` (theta merge driver) versus the
script a user would otherwise write (torch.load of the three full models, the same math, torch.save).

Model: fp32, random normal * 0.02: 10 layers x (q,k,v,o 768x768, fc1/fc2 768x3072, 2 biases, 2 norms) +
token embeddings 8192x768 (the largest group, 24 MiB) ~ 310 MiB, 91 groups. Both branches change EVERY group
(base + independent noise), so every group is merged by the strategy.

Contenders, each in its own subprocess, wall time and peak RSS (psutil polling of the process tree every 20 ms:
sum over the tree, and the largest single process):
  theta    `git merge` with GIT_THETA_MERGE_STRATEGY=average / ties (merge driver + smudge of the result)
  torch    python: torch.load x3 (weights_only, mmap=False) + the same math in torch + torch.save

    python3 scripts/bench/merge.py                 # ~310 MiB
    python3 scripts/bench/merge.py --layers 2      # quick look (~80 MiB)
    python3 scripts/bench/merge.py --big-group-mib 256   # one 256 MiB group: the driver's memory bound

Large files go under --workdir (default /tmp/theta-bench-merge), never into the repository.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from harness import MiB, git_env, run_measured

ROOT = Path(__file__).resolve().parents[2]


def make_models(workdir: Path, layers: int, big_mib: int = 0) -> tuple[list[str], int, int]:
    """base/ours/theirs .pt files; returns (group names, total bytes, largest group bytes)."""
    import torch

    g = torch.Generator().manual_seed(0)
    if big_mib:  # one large group: checks the memory bound of the merge driver
        base = {"big.weight": torch.randn(big_mib * MiB // 4 // 1024, 1024, generator=g) * 0.02}
    else:
        base = {"embed.weight": torch.randn(8192, 768, generator=g) * 0.02}
    for i in range(0 if big_mib else layers):
        for m in ("q", "k", "v", "o"):
            base[f"layers.{i}.attn.{m}.weight"] = torch.randn(768, 768, generator=g) * 0.02
        base[f"layers.{i}.mlp.fc1.weight"] = torch.randn(3072, 768, generator=g) * 0.02
        base[f"layers.{i}.mlp.fc2.weight"] = torch.randn(768, 3072, generator=g) * 0.02
        base[f"layers.{i}.mlp.fc1.bias"] = torch.zeros(3072)
        base[f"layers.{i}.mlp.fc2.bias"] = torch.zeros(768)
        base[f"layers.{i}.norm1.weight"] = torch.ones(768)
        base[f"layers.{i}.norm2.weight"] = torch.ones(768)
    torch.save(base, workdir / "base.pt")
    for name, seed in (("ours", 1), ("theirs", 2)):
        gg = torch.Generator().manual_seed(seed)
        torch.save({k: v + torch.randn(v.shape, generator=gg) * 0.002 for k, v in base.items()}, workdir / f"{name}.pt")
    sizes = [v.numel() * 4 for v in base.values()]
    return list(base), sum(sizes), max(sizes)


TORCH_SCRIPT = textwrap.dedent("""
    import sys, torch
    strategy, base, ours, theirs, out = sys.argv[1:6]
    O = torch.load(base, weights_only=True); A = torch.load(ours, weights_only=True)
    B = torch.load(theirs, weights_only=True)
    res = {}
    for k in O:
        o, a, b = O[k], A[k], B[k]
        if strategy == "average":
            res[k] = 0.5 * a + 0.5 * b
        else:  # ties, density 0.2, lambda 1
            taus = []
            for t in (a - o, b - o):
                kk = max(1, round(0.2 * t.numel()))
                th = t.abs().flatten().kthvalue(t.numel() - kk + 1).values
                taus.append(torch.where(t.abs() >= th, t, torch.zeros_like(t)))
            s = torch.stack(taus)
            elected = torch.sign(s.sum(0))
            agree = (s != 0) & (torch.sign(s) == elected)
            res[k] = o + (s * agree).sum(0) / agree.sum(0).clamp(min=1)
    torch.save(res, out)
""")


def git(args, cwd, env):
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench-merge"))
    ap.add_argument("--strategies", default="average,ties")
    ap.add_argument("--big-group-mib", type=int, default=0,
                    help="instead of the layered model, one group of this many MiB (memory bound check)")
    args = ap.parse_args()

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    home = work / "home"
    env = git_env(home, pythonpath=True)

    names, total, largest = make_models(work, args.layers, args.big_group_mib)
    print(f"model: {len(names)} groups, {total / MiB:.0f} MiB fp32, largest group {largest / MiB:.1f} MiB; "
          f"every group changed on both branches")

    repo = work / "repo"
    git(["init", "-q", str(repo)], work, env)
    subprocess.run(["git", "theta", "install", "--local"], cwd=repo, env=env, check=True, capture_output=True)
    subprocess.run(["git", "theta", "track", "*.pt"], cwd=repo, env=env, check=True, capture_output=True)
    shutil.copy(work / "base.pt", repo / "model.pt")
    git(["add", ".gitattributes", "model.pt"], repo, env)
    git(["commit", "-qm", "base"], repo, env)
    git(["checkout", "-qb", "other"], repo, env)
    shutil.copy(work / "theirs.pt", repo / "model.pt")
    git(["commit", "-qam", "theirs"], repo, env)
    git(["checkout", "-q", "main"], repo, env)
    shutil.copy(work / "ours.pt", repo / "model.pt")
    git(["commit", "-qam", "ours"], repo, env)

    # the three metadata texts git hands the merge driver, to time the driver alone
    for role, rev in (("O", "HEAD~1"), ("B", "other")):
        (work / role).write_bytes(subprocess.run(["git", "cat-file", "blob", f"{rev}:model.pt"], cwd=repo, env=env,
                                                 check=True, capture_output=True).stdout)
    ours_meta = subprocess.run(["git", "cat-file", "blob", "HEAD:model.pt"], cwd=repo, env=env, check=True,
                               capture_output=True).stdout

    rows = []
    for strategy in args.strategies.split(","):
        m_env = dict(env, GIT_THETA_MERGE_STRATEGY=strategy)
        (work / "A").write_bytes(ours_meta)
        driver = run_measured(["git-theta", "merge-driver", str(work / "O"), str(work / "A"), str(work / "B"), "7",
                               "model.pt"], repo, m_env)
        theta = run_measured(["git", "merge", "--no-edit", "other"], repo, m_env)
        git(["reset", "-q", "--hard", "HEAD~1"], repo, env)  # back to ours for the next contender
        torch_m = run_measured([sys.executable, "-c", TORCH_SCRIPT, strategy, str(work / "base.pt"),
                                str(work / "ours.pt"), str(work / "theirs.pt"), str(work / f"merged-{strategy}.pt")],
                               work, env)
        rows.append((strategy, theta, torch_m, driver))

    budget = 4 * largest + 150 * MiB
    print(f"\n{'strategy':<9} {'contender':<40} {'wall s':>7} {'CPU s':>7} {'tree RSS MiB':>13} {'max proc MiB':>13}")
    for strategy, theta, torch_m, driver in rows:
        for label, m in (("theta  git merge (driver + smudge)", theta), ("theta  merge driver alone", driver),
                         ("torch  load x3 + math + save", torch_m)):
            print(f"{strategy:<9} {label:<40} {m.seconds:>7.1f} {m.cpu:>7.1f} {m.peak_tree_rss / MiB:>13.0f} {m.peak_proc_rss / MiB:>13.0f}")
        print(f"{'':<9} {'ratio git merge / torch':<40} {theta.seconds / torch_m.seconds:>7.2f} {theta.cpu / torch_m.cpu:>7.2f} "
              f"{theta.peak_tree_rss / torch_m.peak_tree_rss:>13.2f} {theta.peak_proc_rss / torch_m.peak_proc_rss:>13.2f}")
        print(f"{'':<9} {'ratio merge driver / torch':<40} {driver.seconds / torch_m.seconds:>7.2f} {driver.cpu / torch_m.cpu:>7.2f} "
              f"{driver.peak_tree_rss / torch_m.peak_tree_rss:>13.2f} {driver.peak_proc_rss / torch_m.peak_proc_rss:>13.2f}")
    print(f"\npeak RSS budget for the merge driver (4 x largest group + 150 MiB): {budget / MiB:.0f} MiB; measured: "
          + ", ".join(f"{s} {d.peak_proc_rss / MiB:.0f} MiB" for s, _, _, d in rows)
          + f"\nlargest process inside `git merge`: "
          + ", ".join(f"{s} {t.peak_proc_rss / MiB:.0f} MiB ({t.peak_proc_name})" for s, t, _, _ in rows)
          + "\n(git itself buffers the whole smudged file in memory when it writes a filtered file to the work tree)")


if __name__ == "__main__":
    main()
