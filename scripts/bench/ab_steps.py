#!/usr/bin/env python3
"""A/B of code or environment variants on three steps a user waits for, at any model size: the add of a
partial change (every 5th group changed), the add of a full fine-tune, and the checkout of the previous
version.

The model is scripts/bench/git.py's BERT-shaped history at ``--scale`` (1: 195 groups, 414 MiB; 7.5: 1,443
groups, 3.0 GiB), written group by group (bounded memory) to torch files under ``--workdir``: v1; v2 with
every 5th group x(1+1e-3 N(0,1)); v3 a full fine-tune of v2 (every group so changed). One repository (one
store and one work tree: a multi-GB model's disk use counted once) holds v1 and v2 on main; one cycle checks
out v1, adds v2 over it, goes back to main (nothing to write: the index holds v2), adds v3, undoes that add
and copies v2 back (see :func:`cycle`). Every measured command runs after letting the index settle (no racy
re-clean inside it).

Each round runs one cycle per variant, each variant first in turn, so a drifting load on a shared machine
hits them all alike. Printed per step and variant: wall seconds of the command (median, min-max over the
rounds), CPU seconds of its process tree (median) and peak RSS, then each variant's median wall against the
first variant's, and the median of the per-round differences (the pairs share a round's load).

A variant is a checkout of this project (first on PYTHONPATH) with environment variables after ``@``:

    python3 scripts/bench/ab_steps.py --scale 7.5 --rounds 5 --variants /tmp/main,.,.@GIT_THETA_THREADS=1

Large files go under --workdir (default /tmp/theta-bench/ab-steps): the versions (kept for the next run) and
the repository (``--clean`` removes it). A cycle starts only with --min-free-gib free on that disk, and one that
fails is run again from main. ``--json``
keeps every measurement (one JSON line each), so runs cut short can go on (``--first-round``) and be reported
together (``--report-from``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from git import group_shapes, load_line, settle  # noqa: E402  (scripts/bench/git.py)
from harness import Measure, git_env, new_repo, run_measured, sh, variant_env  # noqa: E402

STEPS = ("20% add", "fine-tune add", "checkout previous")


# -- the model ------------------------------------------------------------------------------------------------
def group_value(i: int, name: str, shape: tuple, version: int, seed: int = 0):
    """Group ``i`` of version 1, 2 or 3, each group from its own generators (so any group is made alone)."""
    import numpy as np

    if name.startswith("final_ln."):
        x = np.ones(shape, np.float32) if name.endswith("weight") else np.zeros(shape, np.float32)
    else:
        x = np.random.default_rng([seed, 1, i]).standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if ".ln" in name and name.endswith("weight"):
            x += np.float32(1)

    def tune(x, v):
        noise = np.random.default_rng([seed, v, i]).standard_normal(shape, dtype=np.float32)
        return (x * (1 + np.float32(1e-3) * noise)).astype(np.float32)

    if version >= 2 and i % 5 == 0:
        x = tune(x, 2)
    if version >= 3:
        x = tune(x, 3)
    return x


def make_versions(data: Path, scale: float) -> list[Path]:
    """v1, v2, v3 at ``scale`` (torch files, written once per scale under ``data``, one group in memory)."""
    import zipslice
    from zipslice.info import TensorSource

    data.mkdir(parents=True, exist_ok=True)
    shapes = group_shapes(scale)
    paths = []
    for version in (1, 2, 3):
        path = data / f"ab-s{scale:g}-v{version}.pt"
        paths.append(path)
        if path.exists():
            continue

        def reader(i, name, shape, version=version):
            return lambda: memoryview(group_value(i, name, shape, version).reshape(-1)).cast("B")

        srcs = [(name, TensorSource(name=name, dtype="float32", shape=shape, read=reader(i, name, shape)))
                for i, (name, shape) in enumerate(shapes)]
        zipslice.save(path, srcs, format="torch")
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB, {len(shapes)} groups)", flush=True)
    return paths


# -- the variants ---------------------------------------------------------------------------------------------
def commit(repo: Path, src: Path, msg: str, env: dict) -> None:
    shutil.copyfile(src, repo / "model.pt")
    sh(["git", "add", "model.pt"], repo, env)
    sh(["git", "commit", "-q", "-m", msg], repo, env)


def setup(root: Path, versions: list[Path], env: dict) -> Path:
    """One repository (one copy of the store and of the work tree, a multi-GB model's disk use kept to one):
    v1 then v2 committed on main."""
    repo = new_repo(root, "repo", "theta", env)
    commit(repo, versions[0], "v1", env)
    commit(repo, versions[1], "v2", env)
    return repo


def cycle(repo: Path, versions: list[Path], env: dict) -> dict[str, Measure]:
    """The three steps once, from and back to main (v2) with a clean work tree:
    checkout of v1 (measured) -> v2 copied in and added (measured: the 20% add over v1; the index then holds
    main's v2, so going back to main writes nothing) -> v3 copied in and added (measured: the fine-tune add) ->
    the add undone and v2 copied back (its re-clean, unmeasured, finds every group unchanged)."""
    _, v2, v3 = versions
    got = {}
    settle(repo, env)
    got["checkout previous"] = run_measured(["git", "checkout", "-q", "HEAD~1"], repo, env)
    shutil.copyfile(v2, repo / "model.pt")
    settle(repo, env)
    got["20% add"] = run_measured(["git", "add", "model.pt"], repo, env)
    sh(["git", "checkout", "-q", "main"], repo, env)
    shutil.copyfile(v3, repo / "model.pt")
    settle(repo, env)
    got["fine-tune add"] = run_measured(["git", "add", "model.pt"], repo, env)
    sh(["git", "reset", "-q"], repo, env)
    shutil.copyfile(v2, repo / "model.pt")
    settle(repo, env)
    if sh(["git", "status", "--porcelain", "--untracked-files=no"], repo, env).strip():
        raise SystemExit(f"{repo}: the work tree is not back to v2")
    return got


def retried_cycle(repo: Path, versions: list[Path], env: dict, min_free: float, tries: int = 3) -> dict:
    """:func:`cycle` once the disk has ``min_free`` bytes free; where a command of it fails (on a shared
    machine: the disk filled by others meanwhile), the repository is put back on main and the cycle run again
    (a failed cycle records nothing)."""
    for attempt in range(1, tries + 1):
        wait_for_disk(repo, min_free)
        try:
            return cycle(repo, versions, env)
        except SystemExit as e:
            if attempt == tries:
                raise
            print(f"a cycle failed ({str(e).strip().splitlines()[-1]}); the repository back on main, once more",
                  flush=True)
            wait_for_disk(repo, min_free)
            subprocess.run(["git", "reset", "-q", "--hard"], cwd=repo, env=env, capture_output=True)
            sh(["git", "checkout", "-q", "-f", "main"], repo, env)
            sh(["git", "reset", "-q", "--hard", "main"], repo, env)
    raise AssertionError("unreachable")


def wait_for_disk(path: Path, need: float, poll: float = 30.0) -> None:
    """Wait until ``path``'s disk has ``need`` bytes free (a shared machine's disk fills and empties)."""
    said = False
    while (free := shutil.disk_usage(path).free) < need:
        if not said:
            print(f"waiting for {need / 2**30:.0f} GiB free on {path} ({free / 2**30:.1f} now)", flush=True)
            said = True
        time.sleep(poll)


ROUND_LINE = re.compile(r"round (\d+) (.+) (\S+): ([\d.]+) s wall, ([\d.]+) s CPU \(load ([\d.]+)\)")


def read_measurements(paths: list[Path]) -> list[dict]:
    """The measurements of earlier runs: the lines of ``--json`` files, or the per-round lines this script
    prints (a run's log, its peak RSS not in it). Each file is one run: its rounds are paired among themselves
    only (``run``: the file's position)."""
    out = []
    for n, path in enumerate(paths):
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                out.append({**json.loads(line), "run": n})
            elif (m := ROUND_LINE.fullmatch(line.strip())) and m[2] in STEPS:
                out.append({"round": int(m[1]), "step": m[2], "variant": m[3], "seconds": float(m[4]),
                            "cpu": float(m[5]), "load": float(m[6]), "run": n})
    return out


def in_turn(specs: list[str], r: int) -> list[str]:
    """The variants in round ``r``'s order: each variant first in turn, so a drifting load hits them all alike."""
    return specs[r % len(specs):] + specs[:r % len(specs)]


def keep(records: list[dict], json_path: Path | None, **rec) -> dict:
    """Add one measurement to ``records`` and, with ``--json``, append it to that file as a JSON line."""
    records.append(rec)
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def report(records: list[dict], specs: list[str], steps: tuple = STEPS) -> None:
    """Per step (of ``steps``) and variant: wall (median, min-max), CPU (median), peak RSS; against the first variant, the
    ratio of medians and the median of the per-round differences (pairs measured in the same round of the
    same run)."""
    base = specs[0]
    for step in steps:
        print(f"\n{step}:")
        of = {spec: {(r.get("run", 0), r["round"]): r for r in records if r["step"] == step and r["variant"] == spec}
              for spec in specs}
        for spec in specs:
            rs = list(of[spec].values())
            if not rs:
                continue
            wall, cpu = [r["seconds"] for r in rs], [r["cpu"] for r in rs]
            rss = [r["rss"] for r in rs if "rss" in r]
            line = (f"  {spec}: wall median {statistics.median(wall):.2f} s (min {min(wall):.2f}, max "
                    f"{max(wall):.2f}), CPU median {statistics.median(cpu):.2f} s, peak RSS "
                    f"{f'{max(rss) / 2**20:.0f} MiB' if rss else 'n/a'} ({len(rs)} rounds)")
            ref = of[base]
            pairs = [(r["seconds"] - ref[n]["seconds"], r["cpu"] - ref[n]["cpu"]) for n, r in of[spec].items()
                     if n in ref]
            if spec != base and pairs:
                ref_wall = statistics.median(r["seconds"] for r in ref.values())
                ref_cpu = statistics.median(r["cpu"] for r in ref.values())
                dw, dc = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
                line += (f"\n      against {base}: median wall {statistics.median(wall) / ref_wall:.3f}x; per-round "
                         f"difference ({len(pairs)} rounds) median {dw:+.2f} s wall ({100 * dw / ref_wall:+.1f}%), "
                         f"{dc:+.2f} s CPU ({100 * dc / ref_cpu:+.1f}%)")
            print(line)
            print(f"      wall per round: {' '.join(f'{w:.2f}' for w in wall)}")
            print(f"      CPU per round: {' '.join(f'{c:.2f}' for c in cpu)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, help="comma-separated checkouts of this project, each optionally "
                    "followed by @NAME=value environment variables; the first is the reference")
    ap.add_argument("--scale", type=float, default=1.0, help="of git.py's BERT-shaped model (1: 414 MiB)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--first-round", type=int, default=1, help="the number of the first round (to go on after "
                    "an interrupted run, appending to the same --json)")
    ap.add_argument("--threads", default="2", help="GIT_THETA_THREADS")
    ap.add_argument("--min-free-gib", type=float, default=10.0, help="wait before each cycle until the work "
                    "directory's disk has this much free (the machine may be shared; a 3 GiB model's cycle writes "
                    "~4 GiB it then drops)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench/ab-steps"))
    ap.add_argument("--json", type=Path, help="append each measurement to this file (JSON lines)")
    ap.add_argument("--report-from", type=Path, nargs="+", metavar="JSON", help="measure nothing: report the "
                    "measurements these --json files hold, for --variants")
    ap.add_argument("--clean", action="store_true", help="remove the repository afterwards")
    args = ap.parse_args()
    specs = args.variants.split(",")
    if args.report_from:
        records = read_measurements(args.report_from)
        report([r for r in records if r["variant"] in specs], specs)
        return 0
    root = args.workdir / f"s{args.scale:g}"
    root.mkdir(parents=True, exist_ok=True)
    env = {**git_env(root / "home"), "GIT_THETA_THREADS": args.threads}
    envs = {s: {**env, **variant_env(s)} for s in specs}
    sh(["git", "lfs", "install"], root / "home", envs[specs[0]])
    sh(["git", "theta", "install"], root / "home", envs[specs[0]])
    versions = make_versions(args.workdir / "data", args.scale)
    repo = setup(root, versions, envs[specs[0]])
    records: list[dict] = []
    try:
        for r in range(args.first_round, args.first_round + args.rounds):
            for spec in in_turn(specs, r):
                for step, m in retried_cycle(repo, versions, envs[spec], args.min_free_gib * 2**30).items():
                    rec = keep(records, args.json, round=r, step=step, variant=spec, seconds=m.seconds, cpu=m.cpu,
                               rss=m.peak_tree_rss, load=os.getloadavg()[0], scale=args.scale)
                    print(f"round {r} {step} {spec}: {m.seconds:.2f} s wall, {m.cpu:.2f} s CPU "
                          f"(load {rec['load']:.1f})", flush=True)
    finally:
        if args.clean:
            shutil.rmtree(repo, ignore_errors=True)
        report(records, specs)
        print(f"\n{load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
