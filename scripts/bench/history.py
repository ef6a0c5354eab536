#!/usr/bin/env python3
"""What `git theta log` costs on the Llama-3-8B-shaped checkpoint (3.85 GB, bf16, two safetensors shards:
scripts/bench/llama_model.py). What recording the norms costs an add is an A/B of code: scripts/bench/norms_add.py.

    python3 scripts/bench/history.py --commits 50 --limit 512M
    python3 scripts/bench/history.py --scale 0.25         # a proportionally small model (a quick look)

``base``, ``finetune`` and ``partial`` committed through `git theta add` (real clean, real git); the
history then extended to ``--commits`` commits by committing those three metadata texts again in turn (git
plumbing: a log reads only these texts, whatever made them; the blobs they name are in the store). Then, in a
memory cgroup of ``--limit`` (below the 1.0 GB embedding) where this machine allows one:

- `git theta log --html` over all of them, and `--png` (metadata only: the norms recorded at add time);
- the same history with the norms taken out of every text (as a theta before them committed it):
  the default log (estimated from LSH signatures, metadata only) and `--exact` over the three real commits
  (each changed group's two values read block by block: what a log costs without recorded norms).

Every figure is printed with the command that made it; the machine is shared, so wall times vary: compare
CPU seconds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from harness import MemCgroup, MiB, git_env, run_measured, sh, this_checkout_first  # noqa: E402

from llama_model import INDEX, LLAMA3_8B_4L, SHARDS, write_version  # noqa: E402


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


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


def run(data: Path, dims, commits: int, limit: int, work: Path, keep_data: bool) -> None:
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
        for s in (*SHARDS, INDEX):  # hard links: the work tree costs no disk beside the versions
            (repo / s).unlink(missing_ok=True)
            os.link(src / s, repo / s)
        m = run_measured(["git", "add", *SHARDS, INDEX], repo, env)
        sh(["git", "commit", "-q", "-m", version], repo, env)
        print(f"  git add {version}: {m.seconds:.1f} s wall, {m.cpu:.1f} s CPU", flush=True)
        if len(made) >= 2 and not keep_data:  # (partial is made from finetune, finetune from base)
            shutil.rmtree(made[-2], ignore_errors=True)
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
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension times this (default 1: real shapes)")
    ap.add_argument("--commits", type=int, default=50)
    ap.add_argument("--limit", default="512M", help="memory cgroup of the log commands (default 512M)")
    ap.add_argument("--keep", action="store_true", help="keep --work and the versions made in --data afterwards "
                                                        "(default: each version is deleted once the next is made)")
    a = ap.parse_args()
    dims = LLAMA3_8B_4L if a.scale == 1 else LLAMA3_8B_4L.scaled(a.scale)
    a.work.mkdir(parents=True, exist_ok=True)
    print(f"model: {dims} ({dims.nbytes() / 1e9:.2f} GB); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    try:
        run(a.data, dims, a.commits, parse_size(a.limit), a.work, a.keep)
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
