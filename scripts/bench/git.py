#!/usr/bin/env python3
"""Benchmark: the same checkpoint history under plain git-lfs and under git-theta, side by side.

The history of issue #17 (fp32, random normal * 0.02, saved with torch.save; see make_history):
  first version          a BERT-base-like checkpoint (embed 30522x768 = 89 MiB, 12 layers, 195 groups, ~420 MiB)
  20% of groups changed  every 5th group x(1+1e-3 N(0,1))
  full fine-tune         every float group x(1+1e-3 N(0,1)) (auto stores deltas)
  vocabulary trim        the fine-tune with the embedding cut to 30000 rows
  checkout v1            of the first version (after letting the index settle: no racy-git re-clean inside)
For each step and both tools (best of --runs): wall time of `git add` + `git commit` (or `git checkout`), CPU
seconds and peak RSS of the whole process tree (psutil polling every 20 ms), stored bytes, then the issue's ratio
lines and the memory bound 2 x largest group + 150 MiB. Exit status 1 when a target or the bound is missed.

    python3 scripts/bench/git.py                       # the issue's history, both tools, best of 3
    python3 scripts/bench/git.py --threads 1,2         # theta with 1 and 2 worker threads (scaling)
    python3 scripts/bench/git.py --scale 0.25 --runs 1 --tools theta   # quick look, memory bound only
    python3 scripts/bench/git.py --big                 # 4 GiB checkpoint of 64 MiB groups: theta peak RSS

Large files go under --workdir (default /tmp/theta-bench), never into the repository.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

from harness import Measure, MiB, dir_bytes, git_env, new_repo, run_measured, sh


def stored_bytes(repo: Path) -> int:
    return dir_bytes(repo / ".git" / "objects", repo / ".git" / "lfs" / "objects")


# -- the history (issue #17) ---------------------------------------------------------------------------------
VOCAB, TRIMMED_VOCAB, D, FF, LAYERS = 30522, 30000, 768, 3072, 12  # BERT-base: embed 30522x768 fp32 = 89 MiB
STEPS = ("first version", "20% of groups changed", "full fine-tune", "vocabulary trim", "checkout v1")


def model_dims(scale: float) -> tuple[int, int, int]:
    """(vocabulary, trimmed vocabulary, layers) of the history at ``scale`` (1: the issue's BERT model)."""
    vocab = max(64, int(VOCAB * scale))
    trimmed = max(32, int(vocab * TRIMMED_VOCAB / VOCAB))
    return vocab, trimmed, max(1, round(LAYERS * scale))


def largest_group_bytes(scale: float) -> int:
    vocab, _, _ = model_dims(scale)
    return max(vocab * D, FF * D) * 4


def make_history(data: Path, scale: float, seed: int = 0) -> tuple[list[Path], dict]:
    """The issue's four versions (fp32 torch files, written once per scale under ``data``):

    v1 a BERT-like checkpoint (embed vocab x 768, 12 layers x (q,k,v,o, fc1, fc2 + biases, 2 layer norms),
       final norm: 195 groups at scale 1); v2 every 5th group changed (20% of groups, each x(1+1e-3 N(0,1)));
    v3 a full fine-tune of v2 (every float group x(1+1e-3 N(0,1))); v4 v3 with the vocabulary trimmed
       (embedding rows cut to 30000 at scale 1).
    """
    import numpy as np
    import torch

    vocab, trimmed, n_layers = model_dims(scale)
    data.mkdir(parents=True, exist_ok=True)
    paths = [data / f"issue17-s{scale:g}-v{i}.pt" for i in (1, 2, 3, 4)]
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))

    sd: OrderedDict = OrderedDict()
    sd["embed.weight"] = randn(vocab, D)
    for i in range(n_layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            sd[p + f"attn.{m}.weight"] = randn(D, D)
            sd[p + f"attn.{m}.bias"] = randn(D)
        sd[p + "mlp.fc1.weight"] = randn(FF, D)
        sd[p + "mlp.fc1.bias"] = randn(FF)
        sd[p + "mlp.fc2.weight"] = randn(D, FF)
        sd[p + "mlp.fc2.bias"] = randn(D)
        for ln in ("ln1", "ln2"):
            sd[p + f"{ln}.weight"] = 1 + randn(D)
            sd[p + f"{ln}.bias"] = randn(D)
    sd["final_ln.weight"] = np.ones(D, np.float32)
    sd["final_ln.bias"] = np.zeros(D, np.float32)

    def tune(x):
        return (x * (1 + np.float32(1e-3) * rng.standard_normal(x.shape, dtype=np.float32))).astype(np.float32)

    keys = list(sd)
    changed = keys[::5]
    v2 = OrderedDict((k, tune(v) if k in changed else v) for k, v in sd.items())
    v3 = OrderedDict((k, tune(v)) for k, v in v2.items())
    v4 = OrderedDict(v3)
    v4["embed.weight"] = np.ascontiguousarray(v3["embed.weight"][:trimmed])
    if not all(p.exists() for p in paths):
        for path, version in zip(paths, (sd, v2, v3, v4)):
            torch.save(OrderedDict((k, torch.from_numpy(v)) for k, v in version.items()), path)
    total = sum(v.nbytes for v in sd.values())
    info = {"groups": len(sd), "bytes": total, "changed_groups": len(changed),
            "changed_bytes": sum(sd[k].nbytes for k in changed), "largest": max(v.nbytes for v in sd.values()),
            "vocab": vocab, "trimmed": trimmed}
    return paths, info


def make_big(data: Path, gib: float) -> Path:
    """A checkpoint of ``gib`` GiB made of 64 MiB fp32 groups, written group by group (bounded memory)."""
    import numpy as np
    import zipslice
    from zipslice.info import TensorSource

    n = int(gib * 1024 / 64)
    rows, cols = 4096, 4096  # 16 Mi floats = 64 MiB
    data.mkdir(parents=True, exist_ok=True)
    out = data / f"big-{gib:g}g.pt"
    if out.exists():
        return out

    def reader(i):
        def read():
            rng = np.random.default_rng(i)
            return memoryview((rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).reshape(-1)).cast("B")
        return read

    srcs = [TensorSource(name=f"block.{i}.weight", dtype="float32", shape=(rows, cols), read=reader(i))
            for i in range(n)]
    zipslice.save(out, [(s.name, s) for s in srcs], format="torch")
    return out


def commit_version(repo: Path, src: Path, msg: str, env: dict) -> Measure:
    shutil.copyfile(src, repo / "model.pt")
    m = run_measured(["git", "add", "model.pt"], repo, env)
    c = run_measured(["git", "commit", "-q", "-m", msg], repo, env)
    return Measure(seconds=m.seconds + c.seconds, cpu=m.cpu + c.cpu,
                   peak_tree_rss=max(m.peak_tree_rss, c.peak_tree_rss), peak_proc_rss=max(m.peak_proc_rss, c.peak_proc_rss),
                   peak_proc_name=m.peak_proc_name if m.peak_proc_rss >= c.peak_proc_rss else c.peak_proc_name,
                   peak_filter_rss=max(m.peak_filter_rss, c.peak_filter_rss), cgroup_peak=max(m.cgroup_peak, c.cgroup_peak))


def run_history(root: Path, paths: list[Path], tool: str, env: dict, name: str | None = None
                ) -> list[tuple[str, Measure, int]]:
    """One run of the issue's history in a fresh repository: add+commit of every version, then checkout of v1."""
    repo = new_repo(root, name or tool, tool, env)
    rows = []
    base = stored_bytes(repo)
    for step, p in zip(STEPS, paths):
        m = commit_version(repo, p, step, env)
        rows.append((step, m, stored_bytes(repo) - base))
    first = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], cwd=repo, env=env, capture_output=True,
                           text=True, check=True).stdout.split()[1]
    # "Racy git": a file written in the same second as the index is re-cleaned by git at the next refresh,
    # i.e. inside the measured checkout, at random (whether the add crossed a second boundary). Settle it
    # first, unmeasured and the same for both tools, so the checkout measures the checkout.
    time.sleep(1.1)
    sh(["git", "update-index", "-q", "--really-refresh"], repo, env)
    m = run_measured(["git", "checkout", "-q", first], repo, env)
    rows.append((STEPS[-1], m, stored_bytes(repo) - base))
    return rows


def best_of_runs(runs: list[list[tuple[str, Measure, int]]]) -> list[tuple[str, Measure, int]]:
    """Per step: the least wall time and CPU seconds over the runs, and the HIGHEST peak RSS (the memory bound
    must hold in every run)."""
    out = []
    for same in zip(*runs):
        ms = [m for _, m, _ in same]
        best = min(ms, key=lambda m: m.seconds)
        out.append((same[0][0], Measure(
            seconds=best.seconds, cpu=min(m.cpu for m in ms),
            peak_tree_rss=max(m.peak_tree_rss for m in ms), peak_proc_rss=max(m.peak_proc_rss for m in ms),
            peak_proc_name=max(ms, key=lambda m: m.peak_proc_rss).peak_proc_name,
            peak_filter_rss=max(m.peak_filter_rss for m in ms), cgroup_peak=max(m.cgroup_peak for m in ms)),
            same[0][2]))
    return out


# ratio targets of issue #17: theta wall time / git-lfs wall time, per step
TARGETS = {"first version": 0.8, "20% of groups changed": 0.35, "full fine-tune": 1.0, "vocabulary trim": 0.8,
           "checkout v1": 1.0}


def memory_limit(largest: int) -> int:
    """The promised bound: 2 x the largest group + 150 MiB."""
    return 2 * largest + 150 * MiB


def print_table(lfs: list, theta: list, label: str = "theta") -> None:
    print(f"{'step':<23}{'wall s lfs':>11}{label:>9}{'ratio':>7}  {'CPU s lfs':>10}{label:>9}{'ratio':>7}  "
          f"{'stored MiB lfs':>15}{label:>9}  {'peak RSS MiB tree lfs':>22}{label:>9}{'filter lfs':>11}{label:>9}")
    for (step, ml, sl), (_, mt, st) in zip(lfs, theta):
        print(f"{step:<23}{ml.seconds:11.2f}{mt.seconds:9.2f}{mt.seconds / ml.seconds:7.2f}  "
              f"{ml.cpu:10.2f}{mt.cpu:9.2f}{mt.cpu / max(ml.cpu, 1e-3):7.2f}  "
              f"{sl / MiB:15.1f}{st / MiB:9.1f}  "
              f"{ml.peak_tree_rss / MiB:22.1f}{mt.peak_tree_rss / MiB:9.1f}"
              f"{ml.peak_filter_rss / MiB:11.1f}{mt.peak_filter_rss / MiB:9.1f}")


def print_targets(lfs: list, theta: list, largest: int) -> bool:
    """The issue's ratio lines and the memory bound for every step; True when all are met."""
    ok = True
    limit = memory_limit(largest)
    print(f"targets (wall-time ratio theta / git-lfs, best of the runs; memory bound 2 x largest group "
          f"({largest / MiB:.1f} MiB) + 150 MiB = {limit / MiB:.0f} MiB, peak RSS of the whole process tree):")
    for (step, ml, _), (_, mt, _) in zip(lfs, theta):
        ratio = mt.seconds / ml.seconds
        cpu_ratio = mt.cpu / max(ml.cpu, 1e-3)
        good_t = ratio <= TARGETS[step]
        good_m = mt.peak_tree_rss <= limit
        ok &= good_t and good_m
        print(f"  {step:<23} time {ratio:5.2f}x (target <= {TARGETS[step]:.2f}x: {'ok' if good_t else 'MISSED'}; "
              f"CPU {cpu_ratio:5.2f}x)   peak RSS {mt.peak_tree_rss / MiB:6.0f} MiB "
              f"(filter {mt.peak_filter_rss / MiB:4.0f}) <= {limit / MiB:.0f}: {'ok' if good_m else 'MISSED'}")
        if step.startswith("checkout") and not good_m:
            print(f"  {'':<23} (git itself holds a filter's whole output at checkout, under git-lfs too: largest "
                  f"process {mt.peak_proc_rss / MiB:.0f} MiB, {mt.peak_proc_name!r}; lfs tree "
                  f"{ml.peak_tree_rss / MiB:.0f} MiB)")
    return ok


def write_json(path: Path, results: dict, info: dict) -> None:
    import json

    out = {"largest": info["largest"], "limit": memory_limit(info["largest"]), "tools": {
        label: [{"step": step, "seconds": m.seconds, "cpu": m.cpu, "peak_tree_rss": m.peak_tree_rss,
                 "peak_proc_rss": m.peak_proc_rss, "peak_proc_name": m.peak_proc_name,
                 "peak_filter_rss": m.peak_filter_rss, "stored": stored} for step, m, stored in rows]
        for label, rows in results.items()}}
    path.write_text(json.dumps(out, indent=1))


def theta_env(env: dict, threads: int) -> dict:
    return {**env, "GIT_THETA_THREADS": str(threads)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the BERT-sized model (default 1)")
    ap.add_argument("--runs", type=int, default=3, help="runs of the history per tool; best of them (default 3)")
    ap.add_argument("--threads", default="2", help="theta's worker threads (GIT_THETA_THREADS); a list such as "
                    "1,2 runs theta once per value and prints the scaling")
    ap.add_argument("--tools", default="lfs,theta", help="which tools to run (theta alone: no ratios)")
    ap.add_argument("--big", action="store_true", help="4 GiB checkpoint of 64 MiB groups: theta peak RSS only")
    ap.add_argument("--big-gib", type=float, default=4.0)
    ap.add_argument("--keep", action="store_true", help="keep the scratch repositories")
    ap.add_argument("--spool", action="store_true", help="also time clean's two input paths (git hash-object of v1)")
    ap.add_argument("--json", type=Path, help="also write every step's figures to this file (for tests)")
    args = ap.parse_args()
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    env = git_env(root / "home", pythonpath=True)  # measure this checkout's code
    threads = [int(t) for t in args.threads.split(",")]
    tools = args.tools.split(",")

    if args.big:
        return big(root, args.big_gib, theta_env(env, threads[0]))

    print(f"making the history under {root} ...", flush=True)
    paths, info = make_history(root / "data", args.scale)
    raw = info["bytes"]
    print(f"checkpoint: {info['groups']} groups, {raw / MiB:.1f} MiB fp32, largest group {info['largest'] / MiB:.1f} MiB;"
          f" v2 changes {info['changed_groups']} groups ({info['changed_groups'] / info['groups']:.0%}, "
          f"{info['changed_bytes'] / MiB:.1f} MiB); v3 fine-tunes all; v4 trims the vocabulary "
          f"{info['vocab']} -> {info['trimmed']} rows", flush=True)
    results: dict[str, list] = {}
    for tool in tools:
        for t in (threads if tool == "theta" else [None]):
            label = tool if t is None else f"{tool}-{t}t"
            e = env if t is None else theta_env(env, t)
            runs = []
            for r in range(args.runs):
                print(f"running {label} ({r + 1}/{args.runs}) ...", flush=True)
                runs.append(run_history(root, paths, tool, e, name=label))
            results[label] = best_of_runs(runs)
            if not args.keep:
                shutil.rmtree(root / label, ignore_errors=True)

    print()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times suffer "
          "when it exceeds the core count; CPU seconds and RSS do not)")
    theta_labels = [k for k in results if k.startswith("theta")]
    ok = True
    if "lfs" in results:
        for label in theta_labels:
            print(f"\n== git-lfs vs {label} (best of {args.runs}) ==")
            print_table(results["lfs"], results[label], label)
            ok &= print_targets(results["lfs"], results[label], info["largest"])
    else:
        limit = memory_limit(info["largest"])
        for label in theta_labels:
            print(f"\n== {label} (best of {args.runs}); memory bound {limit / MiB:.0f} MiB ==")
            for step, m, stored in results[label]:
                print(f"  {step:<23} wall {m.seconds:6.2f}s  CPU {m.cpu:6.2f}s  stored {stored / MiB:7.1f} MiB  "
                      f"peak RSS tree {m.peak_tree_rss / MiB:5.0f} MiB (filter {m.peak_filter_rss / MiB:4.0f}) "
                      f"{'ok' if m.peak_tree_rss <= limit else 'MISSED'}")
                ok &= m.peak_tree_rss <= limit
    if args.json:
        write_json(args.json, results, info)
    if args.spool and theta_labels:
        repo = new_repo(root, "theta", "theta", env)
        commit_version(repo, paths[0], "v1", env)
        spool(root, paths[0], env)
        shutil.rmtree(repo, ignore_errors=True)
    if len(theta_labels) > 1:
        print("\nthread scaling (theta, CPU seconds / wall seconds per step):")
        print(f"  {'step':<23}" + "".join(f"{label:>22}" for label in theta_labels))
        for i, step in enumerate(STEPS):
            print(f"  {step:<23}" + "".join(f"{results[lb][i][1].cpu:9.2f} / {results[lb][i][1].seconds:6.2f}s    "
                                           for lb in theta_labels))
    return 0 if ok else 1


def spool(root: Path, v1: Path, env: dict) -> None:
    """Clean's two ways to get git's bytes: compare against the working-tree file vs spool them to a temp file."""
    repo = root / "theta"
    out = []
    for mode in ("inplace", "always"):
        e = {**env, "GIT_THETA_SPOOL": mode}
        best = min(run_measured(["git", "hash-object", "--path=model.pt", str(v1)], repo, e).seconds
                   for _ in range(2))
        out.append(best)
    print(f"  clean input path (git hash-object of v1, groups unchanged): read in place {out[0]:.2f}s, "
          f"spooled {out[1]:.2f}s")


def big(root: Path, gib: float, env: dict) -> int:
    print(f"making a {gib:g} GiB checkpoint of 64 MiB groups under {root} ...", flush=True)
    path = make_big(root / "data", gib)
    repo = new_repo(root, "theta-big", "theta", env)
    m = commit_version(repo, path, "big", env)
    os.unlink(repo / "model.pt")
    c = run_measured(["git", "checkout", "--", "model.pt"], repo, env)
    limit = 2 * 64 * MiB + 150 * MiB
    for name, x in (("add+commit", m), ("checkout", c)):
        print(f"{name:<11} {x.seconds:7.1f}s (CPU {x.cpu:.1f}s)  peak RSS: theta filter {x.peak_filter_rss / MiB:.0f} MiB"
              f" (limit {limit / MiB:.0f} MiB: {'ok' if x.peak_filter_rss <= limit else 'MISSED'}); whole tree "
              f"{x.peak_tree_rss / MiB:.0f} MiB, largest process {x.peak_proc_rss / MiB:.0f} MiB ({x.peak_proc_name})")
    print(f"stored {stored_bytes(repo) / MiB:.0f} MiB for {path.stat().st_size / MiB:.0f} MiB")
    shutil.rmtree(repo, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
