#!/usr/bin/env python3
"""Paired rounds on the Llama-shaped model (scripts/bench/llama.py's): the steps whose ratios to git-lfs and to
``cp`` the Llama issue sets as targets, each variant measured once per round, with the page cache dropped before
every measured command.

One run of llama.py measures each step once per tool; on a shared 2-CPU machine a step's time moves by +-30 %
from run to run, more than the differences it is asked to show. Here every round measures every variant, in an
order that rotates from round to round, so a drifting load falls on all of them alike; the report gives each
variant's median and the median of its per-round ratios to the first variant (pairs share a round's load).

Variants, comma-separated (the first is the reference the ratios are taken against):

    theta[@PATH][@NAME=value...]   theta from the checkout at PATH (default: this one) with those environment
                                   variables, every process in the memory cgroup (--mem-limit GiB)
    lfs                            git-lfs, no memory limit (as llama.py measures it)
    cp                             the floor of a checkout: ``cp`` of the two shards of the fine-tune

A round of theta or git-lfs makes a fresh repository, adds and commits base (not measured), copies the fine-tune
in and measures ``git add model`` (then commits it, not measured), measures ``git checkout -q HEAD~1`` (to base)
and ``git switch -q main`` (back to the fine-tune), checks after each that the work tree equals the version bit
for bit (sha256) and that ``git status`` is clean, and deletes the repository. A round of ``cp`` copies the
fine-tune's shards. The page cache is dropped before each measured command (``sync``, then
``/proc/sys/vm/drop_caches``; root only, else the run says the caches stay warm): each command starts as after a
reboot, whatever the variant before it left cached.

    python3 scripts/bench/llama_rounds.py --rounds 5 --variants lfs,theta,cp
    python3 scripts/bench/llama_rounds.py --rounds 6 --variants theta@/tmp/before,theta --steps checkout,switch
    python3 scripts/bench/llama_rounds.py --rounds 1 --scale 0.125 --mem-limit 0.25   # a proportionally small model

Without the add among --steps, each variant's repository (base and the fine-tune committed) is made once, by
its first round, and kept for the others: a round then measures the checkout and the switch only. The model's
versions are made once under --workdir/data (shared with llama.py's --workdir); a repository takes ~12 GB for
git-lfs (work tree and objects), ~8 GB for theta.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import llama
import llama_model as lm
from ab_steps import in_turn, keep, report
from harness import ROOT, MemCgroup, git_env, new_repo, run_measured, sh, variant_env

STEPS = ("add fine-tune", "checkout HEAD~1", "switch main", "cp")


def drop_caches() -> bool:
    """Write back and drop the page cache; False where this process may not (not root)."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def parse_variant(spec: str, base_env: dict) -> tuple[str, dict]:
    """``spec`` -> (tool, environment): theta's from its checkout and variables, git-lfs's and cp's as they are."""
    tool, _, rest = spec.partition("@")
    if tool not in ("theta", "lfs", "cp"):
        raise SystemExit(f"unknown variant {spec!r}: theta[@PATH][@NAME=value...], lfs or cp")
    if tool != "theta":
        return tool, base_env
    env = dict(base_env)
    if rest:
        path = rest.split("@")[0]
        if not path or "=" in path:  # only variables: this checkout
            rest = str(ROOT) + "@" + rest
        env.update(variant_env(rest))
    return tool, env


def theta_or_lfs_round(c: llama.Ctx, name: Path, cold: bool, add: bool) -> dict[str, object]:
    """One round's measured steps of a theta or git-lfs variant (see the module's docstring); step -> Measure.
    ``add``: in a fresh repository, the fine-tune's add measured first (else in the variant's repository, made
    by its first round and kept at ``name``: the checkouts leave it on main, as they found it)."""
    if add or not name.exists():
        c.repo = new_repo(c.root, name.name, c.tool, c.env, pattern="model/*.safetensors")
        c.put("base")
        c.git("add", "model")
        c.git("commit", "-q", "-m", "base")
        c.put("finetune")
        if not add:
            c.git("add", "model")
            c.git("commit", "-q", "-m", "finetune")
    c.repo = name
    got = {}
    try:
        for step, cmd, version in (("add fine-tune", ["git", "add", "model"], None),
                                   ("checkout HEAD~1", ["git", "checkout", "-q", "HEAD~1"], "base"),
                                   ("switch main", ["git", "switch", "-q", "main"], "finetune")):
            if version is None and not add:
                continue
            llama.settle(c)
            if cold:
                drop_caches()
            m = got[step] = c.measured(cmd)
            if not m.ok:
                raise SystemExit(f"{c.tool}: {step} failed: {m.status}\n{m.stderr}")
            if version is None:
                c.git("commit", "-q", "-m", "finetune")
                version = "finetune"
            tree = llama.tree_state(c, version)
            if tree != "ok":
                raise SystemExit(f"{c.tool}: after {step} the work tree is not {version}: {tree}")
        return got
    except BaseException:
        shutil.rmtree(name, ignore_errors=True)
        raise
    finally:
        if add:
            shutil.rmtree(name, ignore_errors=True)


def cp_round(c: llama.Ctx, cold: bool) -> dict[str, object]:
    src = c.version("finetune")
    dest = c.root / "rounds-cp"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    try:
        if cold:
            drop_caches()
        return {"cp": run_measured(["cp", *(src / n for n in lm.SHARDS), dest], c.root, c.env, c.cgroup)}
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="lfs,theta,cp", help="comma-separated; the first is the reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", default="", help="comma-separated prefixes of the steps to measure (default all; "
                    "without the add, each variant's repository is kept from round to round)")
    ap.add_argument("--mem-limit", type=float, default=1.0, metavar="GIB", help="theta's memory cgroup (default 1)")
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension of the model times this (default 1)")
    ap.add_argument("--warm", action="store_true", help="leave the page cache as each step finds it")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--json", type=Path, help="append each measurement to this file (JSON lines)")
    ap.add_argument("--report-from", type=Path, metavar="JSON", help="measure nothing: report what this --json "
                    "file holds for --variants and --steps")
    args = ap.parse_args()
    specs = args.variants.split(",")
    prefixes = [p.strip() for p in args.steps.split(",") if p.strip()]
    steps = [s for s in STEPS if not prefixes or s.startswith(tuple(prefixes))]
    if args.report_from:
        records = [json.loads(line) for line in args.report_from.read_text().splitlines() if line.strip()]
        report_all([x for x in records if x["variant"] in specs], specs, steps)
        return 0
    add = "add fine-tune" in steps
    dims = lm.LLAMA3_8B_4L if args.scale == 1 else lm.LLAMA3_8B_4L.scaled(args.scale)
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    env = git_env(root / "home", pythonpath=True)  # theta: this checkout, unless a variant names another
    for tool in ("lfs", "theta"):
        sh(["git", tool, "install"], root, env)
    reason = MemCgroup.available()
    if reason:
        raise SystemExit(f"no memory cgroup can be made here: {reason}")
    cold = not args.warm and drop_caches()
    print(f"{len(specs)} variants x {args.rounds} rounds; page cache "
          f"{'dropped before each measured command' if cold else 'left warm'}; theta in {args.mem_limit:g} GiB; "
          f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)", flush=True)
    variants = {s: parse_variant(s, env) for s in specs}
    repos = {s: root / f"rounds-{i}" for i, s in enumerate(specs)}
    for path in repos.values():
        shutil.rmtree(path, ignore_errors=True)
    records: list[dict] = []
    try:
        for r in range(1, args.rounds + 1):
            for spec in in_turn(specs, r):
                tool, venv = variants[spec]
                limit = int(args.mem_limit * (1 << 30)) if tool == "theta" else 1 << 62
                with MemCgroup(limit, f"rounds-{tool}") as cg:
                    c = llama.Ctx(root, root / "data", dims, venv, tool, cg)
                    got = cp_round(c, cold) if tool == "cp" else theta_or_lfs_round(c, repos[spec], cold, add)
                for step, m in got.items():
                    rec = keep(records, args.json, round=r, step=step, variant=spec, seconds=m.seconds, cpu=m.cpu,
                               rss=m.peak_tree_rss, cgroup_peak=m.cgroup_peak, load=os.getloadavg()[0])
                    print(f"round {r} {step} {spec}: {m.seconds:.2f} s wall, {m.cpu:.2f} s CPU, cgroup peak "
                          f"{m.cgroup_peak / 2**20:.0f} MiB (load {rec['load']:.1f})", flush=True)
    finally:
        for path in repos.values():
            shutil.rmtree(path, ignore_errors=True)
        report_all(records, specs, steps)
    return 0


def per_round_ratios(records: list[dict], specs: list[str]) -> None:
    """Each theta variant's steps against the same round's git-lfs (same step) and ``cp`` (checkouts only):
    the median of the per-round ratios, and each round's."""
    for ref in ("lfs", "cp"):
        of_ref = {(x["round"], x["step"]): x["seconds"] for x in records if x["variant"] == ref}
        if not of_ref:
            continue
        print(f"\nagainst the same round's {ref} (median of the per-round ratios):")
        for spec in specs:
            if spec in ("lfs", "cp"):
                continue
            for step in STEPS[:3] if ref == "lfs" else STEPS[1:3]:
                ratios = [x["seconds"] / of_ref[key] for x in records if x["variant"] == spec and x["step"] == step
                          and (key := (x["round"], step if ref == "lfs" else "cp")) in of_ref]
                if ratios:
                    print(f"  {spec} {step}: {statistics.median(ratios):.2f}x (per round: "
                          f"{' '.join(f'{v:.2f}' for v in ratios)})")


def report_all(records: list[dict], specs: list[str], steps: list[str]) -> None:
    for step in steps:
        # cp is its own step: each checkout is set against the same round's cp in per_round_ratios
        report([x for x in records if x["step"] == step], [s for s in specs if s != "cp" or step == "cp"],
               steps=(step,))
    per_round_ratios(records, specs)


if __name__ == "__main__":
    sys.exit(main())
