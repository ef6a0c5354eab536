#!/usr/bin/env python3
"""What `git theta log` costs on the Llama-3-8B-shaped checkpoint (3.85 GB, bf16, two safetensors shards:
scripts/bench/llama_model.py), and what recording norms at add time costs the add.

    python3 scripts/bench/history.py                      # both parts, the real shapes
    python3 scripts/bench/history.py --part add --rounds 3
    python3 scripts/bench/history.py --part log --commits 50 --limit 512M
    python3 scripts/bench/history.py --scale 0.25         # a proportionally small model (a quick look)

**add**: once ``base`` is committed, theta's clean of ``finetune`` (every element of every group moved: every
group's change is measured) against it, in this process, each shard in turn, alternating rounds with the norms
measured (this code) and with ``theta.model.norms.measure`` replaced by a no-op (the clean without norms; the
blobs it stores are the same): wall and CPU seconds, medians and spread of ``--rounds`` rounds each.

**log**: ``base``, ``finetune`` and ``partial`` committed through `git theta add` (real clean, real git); the
history then extended to ``--commits`` commits by committing those three metadata texts again in turn (git
plumbing: a log reads only these texts, whatever made them; the blobs they name are in the store). Then, in a
memory cgroup of ``--limit`` (below the 1.0 GB embedding) where this machine allows one:

- `git theta log --html` over all of them, and `--png` (metadata only: the norms recorded at add time);
- the same history with the norms taken out of every text (as a theta before them committed it):
  the default log (estimated from LSH signatures, metadata only) and `--exact` over the three real commits
  (each changed group's two values read block by block: what a log costs without recorded norms).

Every figure is printed with the command that made it; the machine is shared, so wall times vary: compare
CPU seconds, and the A/B rounds' medians.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from harness import MemCgroup, MiB, git_env, run_measured, sh, this_checkout_first  # noqa: E402

try:
    from llama_model import INDEX, LLAMA3_8B_4L, SHARDS, write_version  # noqa: E402
except ImportError:  # pragma: no cover - the generator is another benchmark's
    raise SystemExit("scripts/bench/llama_model.py (the Llama-3-8B-shaped checkpoint) is needed")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def cpu_now() -> float:
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------------------------------------- add A/B

def add_ab(repo: Path, tuned: Path, previous: dict, rounds: int, nbytes: int) -> None:
    """Clean ``tuned``'s shards against ``previous`` (their committed metadata) into ``repo``'s store, alternately
    with and without norms, after one clean not counted (the first one writes the blobs; the others find them)."""
    from theta.model import norms
    from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
    from theta.storage.store import LfsStore

    store = LfsStore.for_repo(repo)
    measure = norms.measure

    def off(new, old=None, count=True):
        return norms.Sums()

    spent = [0.0]  # CPU seconds inside norms.measure (on whichever thread called it)

    def timed(new, old=None, count=True):
        t = time.thread_time()
        try:
            return measure(new, old, count)
        finally:
            spent[0] += time.thread_time() - t

    runs: dict[str, list[tuple[float, float]]] = {"norms": [], "no norms": []}
    inside: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for s in SHARDS:
        clean_checkpoint(tuned / s, store, previous[s], CleanOptions())
    print(f"  (a first clean, not counted: {time.perf_counter() - t0:.1f} s)", flush=True)
    for r in range(rounds):
        for variant in ("norms", "no norms") if r % 2 == 0 else ("no norms", "norms"):
            norms.measure = timed if variant == "norms" else off
            spent[0] = 0.0
            t0, c0 = time.perf_counter(), cpu_now()
            recorded = 0
            for s in SHARDS:
                meta = clean_checkpoint(tuned / s, store, previous[s], CleanOptions(), stats=CleanStats())
                recorded += sum(1 for g in meta.groups.values() if g.norms is not None and g.norms.source)
            runs[variant].append((time.perf_counter() - t0, cpu_now() - c0))
            inside.setdefault(variant, []).append(spent[0])
            print(f"  round {r + 1} {variant:9s}: {runs[variant][-1][0]:6.2f} s wall, {runs[variant][-1][1]:6.2f} s "
                  f"CPU, {spent[0]:.2f} s of it measuring norms ({recorded} groups with a recorded change)", flush=True)
    norms.measure = measure
    print(f"\nadd (theta's clean of finetune against base, {nbytes / 1e9:.2f} GB, every group changed), "
          f"{rounds} interleaved rounds each, this process (all threads), shared machine:")
    for variant, rs in runs.items():
        walls, cpus = [w for w, _ in rs], [c for _, c in rs]
        print(f"  {variant:9s} wall median {statistics.median(walls):6.2f} s [{min(walls):.2f}..{max(walls):.2f}]"
              f"  CPU median {statistics.median(cpus):6.2f} s [{min(cpus):.2f}..{max(cpus):.2f}]")
    a = statistics.median(c for _, c in runs["norms"])
    b = statistics.median(c for _, c in runs["no norms"])
    m = statistics.median(inside["norms"])
    print(f"  norms cost {100 * (a / b - 1):+.1f}% CPU ({a - b:+.2f} s) on this add (difference of medians); "
          f"measured inside: {m:.2f} s CPU in theta.model.norms.measure, {100 * m / b:.1f}% of the clean without "
          f"norms\n", flush=True)


# ------------------------------------------------------------------------------------------------- log

def commit_texts(repo: Path, env: dict, texts: list[dict[str, bytes]], message: str, ref: str = "HEAD") -> None:
    """Commit each of ``texts`` (path -> metadata text) in turn on ``ref``, by plumbing (no filter runs, the work
    tree is not touched)."""
    for i, files in enumerate(texts):
        tree_lines = sh(["git", "ls-tree", ref], repo, env).splitlines()
        entries = {line.split("\t", 1)[1]: line for line in tree_lines}
        for path, text in files.items():
            blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, env=env, input=text,
                                  capture_output=True, check=True).stdout.decode().strip()
            entries[path] = f"100644 blob {blob}\t{path}"
        tree = subprocess.run(["git", "mktree"], cwd=repo, env=env, input=("\n".join(entries.values()) + "\n").encode(),
                              capture_output=True, check=True).stdout.decode().strip()
        head = sh(["git", "rev-parse", ref], repo, env).strip()
        c = sh(["git", "commit-tree", tree, "-p", head, "-m", f"{message} {i + 1}"], repo, env).strip()
        sh(["git", "update-ref", ref, c], repo, env)


def strip_norms(text: bytes) -> bytes:
    import re

    return re.sub(rb',"norms":\{[^{}]*\}', b"", text)


def show(label: str, m, cmd: str) -> None:
    cg = f", cgroup peak {m.cgroup_peak / MiB:.0f} MiB" if m.cgroup_peak else ""
    print(f"  {label:46s} {m.seconds:7.2f} s wall, {m.cpu:7.2f} s CPU, peak RSS {m.peak_tree_rss / MiB:.0f} MiB{cg}"
          f"  [{m.status}]\n      $ {cmd}", flush=True)


def run(data: Path, dims, commits: int, limit: int, work: Path, rounds: int, parts: str, keep_data: bool) -> None:
    from theta.storage.metadata import loads

    env = git_env(work / "home", pythonpath=True)
    env["PYTHONPATH"] = this_checkout_first(env)
    repo = work / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    sh(["git", "init", "-q", repo], work, env)
    for cmd in (["git", "theta", "install", "--local"], ["git", "theta", "track", "*.safetensors"],
                ["git", "add", ".gitattributes"], ["git", "commit", "-q", "-m", "attributes"]):
        sh(cmd, repo, env)
    real = ("base", "finetune", "partial")
    print(f"committing {', '.join(real)} ({dims.nbytes() / 1e9:.2f} GB each) through git theta ...", flush=True)
    made: list[Path] = []
    for version in real:
        src = write_version(data, version, dims, progress=True)
        made.append(src)
        if version == "finetune" and parts in ("add", "both"):
            previous = {s: loads(sh(["git", "cat-file", "blob", f"HEAD:{s}"], repo, env)) for s in SHARDS}
            add_ab(repo, src, previous, rounds, dims.nbytes())
            if parts == "add":
                break
        for s in (*SHARDS, INDEX):  # hard links: the work tree costs no disk beside the versions
            (repo / s).unlink(missing_ok=True)
            os.link(src / s, repo / s)
        m = run_measured(["git", "add", *SHARDS, INDEX], repo, env)
        sh(["git", "commit", "-q", "-m", version], repo, env)
        print(f"  git add {version}: {m.seconds:.1f} s wall, {m.cpu:.1f} s CPU", flush=True)
        if len(made) >= 2 and not keep_data:  # (partial is made from finetune, finetune from base)
            shutil.rmtree(made[-2], ignore_errors=True)
    if parts == "add":
        return
    texts = [{s: subprocess.run(["git", "cat-file", "blob", f"HEAD~{2 - k}:{s}"], cwd=repo, env=env,
                                capture_output=True, check=True).stdout for s in SHARDS} for k in range(3)]
    groups = sum(t.count(b'{"dtype":') for t in texts[0].values())
    size = sum(len(t) for t in texts[0].values())
    more = max(0, commits - len(real))
    commit_texts(repo, env, [texts[k % 3] for k in range(more)], "again")
    total = int(sh(["git", "rev-list", "--count", "HEAD", "--", *SHARDS], repo, env))
    print(f"\nlog: {total} commits of {len(SHARDS)} shards, {groups} groups, {size / 1024:.0f} KiB of metadata "
          f"per commit ({len(real)} committed by git theta add, {more} more of the same texts by plumbing)")
    cg = None
    why = MemCgroup.available()
    if why is None:
        cg = MemCgroup(limit, "history")
        print(f"  every command in a memory cgroup of {limit / MiB:.0f} MiB (page cache included)")
    else:
        print(f"  (no memory cgroup: {why})")
    try:
        out = work / "pages"
        shutil.rmtree(out, ignore_errors=True)
        cmd = ["git", "theta", "log", "-q", "--html", str(out)]
        show("log --html (recorded norms)", run_measured(cmd, repo, env, cg), " ".join(cmd[:-1] + ["OUT"]))
        cmd = ["git", "theta", "log", "-q", "--png", str(work / "png")]
        try:
            import matplotlib  # noqa: F401
            show("log --png", run_measured(cmd, repo, env, cg), " ".join(cmd[:-1] + ["OUT"]))
        except ImportError:
            print("  (log --png skipped: no matplotlib)")
        pages = sorted(out.iterdir())
        print(f"  pages: {', '.join(f'{p.name} {p.stat().st_size / 1024:.0f} KiB' for p in pages)}")
        # the same history without norms: a theta before them wrote it
        ref = "refs/heads/no-norms"
        sh(["git", "update-ref", ref, f"HEAD~{total}"], repo, env)
        commit_texts(repo, env, [{s: strip_norms(t[s]) for s in SHARDS} for t in texts], "no norms", ref)
        commit_texts(repo, env, [{s: strip_norms(texts[k % 3][s]) for s in SHARDS} for k in range(more)], "again",
                     ref)
        cmd = ["git", "theta", "log", "-q", "--html", str(work / "pages-estimated"), "no-norms"]
        show("log --html (no norms: LSH estimates)", run_measured(cmd, repo, env, cg),
             " ".join(cmd[:-2] + ["OUT", "no-norms"]))
        base = sh(["git", "rev-parse", f"no-norms~{more}"], repo, env).strip()
        cmd = ["git", "theta", "log", "-q", "--exact", "--json", "-n", "2", base]
        with open(work / "exact.json", "wb") as f:
            m = run_measured(cmd, repo, env, cg, stdout=f)
        show("log --exact, 2 pairs (no norms: values read)", m, " ".join(cmd[:-1] + ["<3rd commit>"]))
        print(f"      (finetune against base: every group; partial against finetune: layer {dims.layers - 1}, "
              f"the norm and 256 rows of the embedding and the head)")
    finally:
        if cg is not None:
            cg.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("/tmp/theta-bench/data"), help="where the versions are made")
    ap.add_argument("--work", type=Path, default=Path("/tmp/theta-bench/history"), help="repositories, stores")
    ap.add_argument("--part", choices=("add", "log", "both"), default="both")
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension times this (default 1: real shapes)")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds of the add (each variant)")
    ap.add_argument("--commits", type=int, default=50)
    ap.add_argument("--limit", default="512M", help="memory cgroup of the log commands (default 512M)")
    ap.add_argument("--stream-mib", type=float, default=None,
                    help="clean groups of this many MiB or more frame by frame (theta.model.framewise.STREAM_BYTES; "
                         "default 32): at a small --scale, a low value takes the path the real shapes take")
    ap.add_argument("--keep", action="store_true", help="keep --work and the versions made in --data afterwards "
                                                        "(default: each version is deleted once the next is made)")
    a = ap.parse_args()
    dims = LLAMA3_8B_4L if a.scale == 1 else LLAMA3_8B_4L.scaled(a.scale)
    if a.stream_mib is not None:
        from theta.model import framewise

        framewise.STREAM_BYTES = int(a.stream_mib * MiB)
        print(f"groups of {a.stream_mib} MiB or more cleaned frame by frame (in this process: the add A/B)")
    a.work.mkdir(parents=True, exist_ok=True)
    print(f"model: {dims} ({dims.nbytes() / 1e9:.2f} GB); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    try:
        run(a.data, dims, a.commits, parse_size(a.limit), a.work, a.rounds, a.part, a.keep)
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
