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

    python3 scripts/bench/ab_steps.py --scale 7.5 --rounds 6 \\
        --variants .,.@GIT_THETA_WARM=0,.@GIT_THETA_LIGHT_START=0,.@GIT_THETA_FORK_RECEIVE=0

Large files go under --workdir (default /tmp/theta-bench/ab-steps): the versions (kept for the next run) and
the repository (``--clean`` removes it). A round starts only with --min-free-gib free on that disk.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from git import D, FF, load_line, model_dims, settle  # noqa: E402  (scripts/bench/git.py)
from harness import Measure, git_env, new_repo, run_measured, sh  # noqa: E402

STEPS = ("20% add", "fine-tune add", "checkout previous")


# -- the model ------------------------------------------------------------------------------------------------
def group_shapes(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    """git.py's make_history layout at ``scale``: the embedding, then per layer q,k,v,o (+ biases), fc1, fc2
    (+ biases), two layer norms, then the final norm."""
    vocab, _, layers = model_dims(scale)
    out = [("embed.weight", (vocab, D))]
    for i in range(layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            out += [(p + f"attn.{m}.weight", (D, D)), (p + f"attn.{m}.bias", (D,))]
        out += [(p + "mlp.fc1.weight", (FF, D)), (p + "mlp.fc1.bias", (FF,)),
                (p + "mlp.fc2.weight", (D, FF)), (p + "mlp.fc2.bias", (D,))]
        for ln in ("ln1", "ln2"):
            out += [(p + f"{ln}.weight", (D,)), (p + f"{ln}.bias", (D,))]
    return out + [("final_ln.weight", (D,)), ("final_ln.bias", (D,))]


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
def variant_env(spec: str) -> dict:
    """``path[@NAME=value...]`` -> the environment that runs it (PYTHONPATH first)."""
    path, *pairs = spec.split("@")
    env = {"PYTHONPATH": str(Path(path).resolve())}
    for pair in pairs:
        name, _, value = pair.partition("=")
        env[name] = value
    return env


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


def report(got: dict[str, dict[str, list[Measure]]], specs: list[str]) -> None:
    base = specs[0]
    for step in STEPS:
        print(f"\n{step}:")
        for spec in specs:
            ms = got[step][spec]
            if not ms:
                continue
            wall = [m.seconds for m in ms]
            line = (f"  {spec}: wall median {statistics.median(wall):.2f} s (min {min(wall):.2f}, max "
                    f"{max(wall):.2f}), CPU median {statistics.median(m.cpu for m in ms):.2f} s, peak RSS "
                    f"{max(m.peak_tree_rss for m in ms) / 2**20:.0f} MiB ({len(ms)} rounds)")
            if spec != base:
                ref = [m.seconds for m in got[step][base]]
                diff = statistics.median(w - r for w, r in zip(wall, ref))
                line += (f"\n      against {base}: median {statistics.median(wall) / statistics.median(ref):.3f}x, "
                         f"per-round difference median {diff:+.2f} s "
                         f"({100 * diff / statistics.median(ref):+.1f}% of {base}'s median)")
            print(line)
            print(f"      wall per round: {' '.join(f'{w:.2f}' for w in wall)}")


def stop_servers(env: dict) -> None:
    """End the warm filter servers this run started (theta.warm.stop), if the code still has them."""
    subprocess.run([sys.executable, "-c", "import theta.warm as w; w.stop()"], env=env, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, help="comma-separated checkouts of this project, each optionally "
                    "followed by @NAME=value environment variables; the first is the reference")
    ap.add_argument("--scale", type=float, default=1.0, help="of git.py's BERT-shaped model (1: 414 MiB)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", default="2", help="GIT_THETA_THREADS")
    ap.add_argument("--min-free-gib", type=float, default=4.0, help="stop before a round when the work "
                    "directory's disk has less free (the machine may be shared)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench/ab-steps"))
    ap.add_argument("--clean", action="store_true", help="remove the repositories afterwards")
    args = ap.parse_args()
    specs = args.variants.split(",")
    root = args.workdir / f"s{args.scale:g}"
    root.mkdir(parents=True, exist_ok=True)
    (args.workdir / "warm").mkdir(mode=0o700, exist_ok=True)
    env = {**git_env(root / "home"), "GIT_THETA_THREADS": args.threads,
           "GIT_THETA_WARM_DIR": str(args.workdir / "warm")}
    envs = {s: {**env, **variant_env(s)} for s in specs}
    sh(["git", "lfs", "install"], root / "home", envs[specs[0]])
    sh(["git", "theta", "install"], root / "home", envs[specs[0]])
    versions = make_versions(args.workdir / "data", args.scale)
    repo = setup(root, versions, envs[specs[0]])
    got: dict[str, dict[str, list[Measure]]] = {s: {v: [] for v in specs} for s in STEPS}
    try:
        for r in range(args.rounds):
            free = shutil.disk_usage(root).free
            if free < args.min_free_gib * 2**30:
                print(f"stopped before round {r + 1}: {free / 2**30:.1f} GiB free on {root} "
                      f"(--min-free-gib {args.min_free_gib:g})", flush=True)
                break
            for spec in specs[r % len(specs):] + specs[:r % len(specs)]:  # (each variant first in turn)
                for step, m in cycle(repo, versions, envs[spec]).items():
                    got[step][spec].append(m)
                    print(f"round {r + 1} {step} {spec}: {m.seconds:.2f} s wall, {m.cpu:.2f} s CPU "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        stop_servers(envs[specs[0]])
        if args.clean:
            shutil.rmtree(repo, ignore_errors=True)
    report(got, specs)
    print(f"\n{load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
