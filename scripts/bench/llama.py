#!/usr/bin/env python3
"""Benchmark: a Llama-3-8B-shaped checkpoint (its first 4 layers, 3.85 GB, 1.0 GB tensors) through every git
command, theta with every process in a memory cgroup, git-lfs and the floor side by side.

The model (scripts/bench/llama_model.py, no download): Hugging Face sharded safetensors, bfloat16, two shards
of 1.92 GB under ``model/``, tracked with ``git theta track 'model/*.safetensors'`` (git-lfs: ``git lfs track``);
the index JSON stays plain text. The history: base, a full fine-tune, a partial change of it (layer 3, the
final norm and the special tokens' rows of the 1 GB embedding and head) on main; another full fine-tune of base
on branch ``ft2`` (merged into main by each numeric strategy); a change of layer 0's MLP on branch ``side``
from the fine-tune (rebased onto main, cherry-picked).

Steps (each measured alone; unmeasured setup between them, e.g. the copy of a version into the work tree):
add base, add fine-tune, add partial (git add + git commit); checkout HEAD~1; switch main; reset --hard
HEAD~2; reset --hard ORIG_HEAD; stash (of a modified shard); stash pop; restore. Before the git steps that change
the history, theta only: the operations that are not git commands (scripts/bench/llama_ops.py): zipslice convert
--dtype float32 (a 7.7 GB zip64 torch file), zipslice show and diff, git theta diff, git diff through the diff
driver, git theta fsck, squash, export, merge-resolve with each numeric strategy, theta.load(...).get_slice. Then
rebase side onto main; push (pre-push uploads the blobs to a file:// remote); clone; cherry-pick side; pull
(fast-forward, in the clone); then, remote and clone deleted, merge ft2 with average, task-arithmetic, TIES, DARE,
SLERP (theta only: GIT_THETA_MERGE_STRATEGY; each undone by an unmeasured reset, its blobs pruned). git-lfs cannot
merge a checkpoint: it gets no merge branches, and its rebase, cherry-pick, pull and merges are "n/a". Disk: about
20 GB of versions under --workdir/data, and up to ~35 GB of repositories at a time.

Per step and tool: wall time, the kernel's peak for the step's cgroup (page cache included), the peak RSS of
the process tree, the exit status, and whether the work tree then equals bit for bit what was committed
(sha256 of every file against the generated version's; for a merge, whose result no file holds: git re-cleans
each shard, touched, and finds the committed metadata -- every group's value hash) and `git status` is clean.
theta runs with every process (git, git-lfs, theta's filter, hooks) in a memory cgroup of --mem-limit GiB
(cgroup v1 or v2, page cache counted; each measured command in a fresh child group of the limited group, its
pid written to cgroup.procs before exec: scripts/bench/memcg.py), git-lfs in a cgroup without a limit (its
peak for comparison). The floor: `cp` of the two shards (a checkout's bytes), `sha256sum` of them (an add
reads and hashes them).

    python3 scripts/bench/llama.py                          # every step, theta in 1 GiB, git-lfs, the floor
    python3 scripts/bench/llama.py --tools theta --steps add,checkout   # only steps whose name starts so
    python3 scripts/bench/llama.py --scale 0.125 --mem-limit 0.25       # a proportionally small model

Exit status 1 when a theta step fails, leaves a work tree other than what was committed, or misses a target
(add and checkout at most 1.0x git-lfs's time; checkout at most 2x cp).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import llama_model as lm
import llama_ops
from harness import Measure, MemCgroup, MiB, git_env, new_repo, run_measured, sh

SHARD1, SHARD2 = (f"model/{s}" for s in lm.SHARDS)
STRATEGIES = ("average", "task-arithmetic", "ties", "dare", "slerp")


@dataclass
class Result:
    step: str
    tool: str
    m: Measure | None = None
    tree: str = ""            # "ok", "n/a", or what differs
    note: str = ""


@dataclass
class Ctx:
    root: Path
    data: Path
    dims: lm.Dims
    env: dict
    tool: str
    cgroup: MemCgroup | None
    repo: Path = None
    clone: Path = None
    bare: Path = None
    digests: dict = field(default_factory=dict)

    def version(self, name: str) -> Path:
        return lm.write_version(self.data, name, self.dims, progress=True)

    def expected(self, name: str) -> dict:
        """path in the repository -> sha256 of version ``name``'s file (versions only compared against, never
        copied in -- "rebased" -- are deleted once hashed: the disk)."""
        if name not in self.digests:
            d = lm.version_dir(self.data, name, self.dims)
            cache = d.with_name(d.name + ".sha256.json")
            if not cache.exists():
                self.version(name)
                cache.write_text(json.dumps(lm.sha256_files(d, lm.SHARDS + (lm.INDEX,))))
                if name == "rebased":
                    shutil.rmtree(d)
            self.digests[name] = {f"model/{k}": v for k, v in json.loads(cache.read_text()).items()}
        return self.digests[name]

    def put(self, version: str, *paths: str, repo: Path | None = None) -> None:
        """Copy ``version``'s files (all, or ``paths``) into the work tree (unmeasured)."""
        src = self.version(version)
        dest = (repo or self.repo) / "model"
        dest.mkdir(exist_ok=True)
        for p in paths or (SHARD1, SHARD2, f"model/{lm.INDEX}"):
            name = Path(p).name
            tmp = dest / f".{name}.copy"
            shutil.copyfile(src / name, tmp)
            os.replace(tmp, dest / name)

    def measured(self, *cmds: list[str], repo: Path | None = None, env: dict | None = None) -> Measure:
        ms = []
        for cmd in cmds:
            ms.append(run_measured(cmd, repo or self.repo, env or self.env, self.cgroup, check=False))
            if not ms[-1].ok:
                break
        return combine(*ms)

    def git(self, *args: str, repo: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(["git", *args], cwd=repo or self.repo, env=self.env, capture_output=True, text=True)
        if check and p.returncode != 0:
            raise SystemExit(f"git {' '.join(args)} failed in {repo or self.repo}:\n{p.stderr}")
        return p


def combine(*ms: Measure) -> Measure:
    """Several commands as one step: times add up, peaks take the maximum, the first failure is the step's."""
    bad = next((m for m in ms if not m.ok), None)
    big = max(ms, key=lambda m: m.peak_proc_rss)
    return Measure(sum(m.seconds for m in ms), sum(m.cpu for m in ms), max(m.peak_tree_rss for m in ms),
                   big.peak_proc_rss, big.peak_proc_name, max(m.peak_filter_rss for m in ms),
                   max(m.cgroup_peak for m in ms), bad.returncode if bad else 0, bad.stderr if bad else "",
                   any(m.oom_killed for m in ms))


# -- checks ----------------------------------------------------------------------------------------------------
def tree_state(c: Ctx, version: str | None, repo: Path | None = None, modified: tuple = ()) -> str:
    """"ok" when every file equals ``version``'s bit for bit and `git status` shows exactly ``modified``
    (paths); else what differs. ``version`` None: a merge's result, checked by re-cleaning (see the docstring)."""
    repo = repo or c.repo
    problems = []
    lock = repo / ".git" / "index.lock"
    if lock.exists():
        problems.append("index.lock left")
    if version is not None:
        for path, want in c.expected(version).items():
            got = lm.sha256_files(repo, (path,))[path]
            if got != want:
                head = (repo / path).open("rb").read(15)
                problems.append(f"{Path(path).name} {'is a placeholder' if head == b'theta-metadata ' else 'differs'}")
    else:
        problems += reclean(c, repo)
    status = c.git("status", "--porcelain", repo=repo).stdout.split("\n")
    dirty = sorted(line[3:] for line in status if line.strip())
    if dirty != sorted(modified):
        problems.append(f"git status: {', '.join(dirty) or 'clean'}")
    return "ok" if not problems else "; ".join(problems)


def reclean(c: Ctx, repo: Path) -> list[str]:
    """The shards re-cleaned by git (touched, so git cannot trust their stat data) give the committed metadata."""
    problems = []
    for path in (SHARD1, SHARD2):
        if (repo / path).open("rb").read(15) == b"theta-metadata ":
            problems.append(f"{Path(path).name} is a placeholder")
            continue
        os.utime(repo / path)
    time.sleep(1.1)
    if c.git("diff", "--quiet", "--", "model", repo=repo, check=False).returncode != 0:
        problems.append("re-cleaned shards differ from the commit")
    c.git("update-index", "-q", "--refresh", repo=repo, check=False)
    return problems


def settle(c: Ctx, repo: Path | None = None) -> None:
    """"Racy git": a file written in the index's second is re-read by git's next refresh -- inside the next
    measured command, at random. Settled first, unmeasured, the same for both tools."""
    time.sleep(1.1)
    c.git("update-index", "-q", "--really-refresh", repo=repo, check=False)


def repair(c: Ctx, *redo: list[str], repo: Path | None = None) -> None:
    """After a failed step: back to a usable repository without the limit (what the step meant to reach)."""
    repo = repo or c.repo
    (repo / ".git" / "index.lock").unlink(missing_ok=True)
    for args in redo:
        subprocess.run(args, cwd=repo, env=c.env, capture_output=True)
    if c.tool == "theta":
        subprocess.run(["git", "theta", "checkout"], cwd=repo, env=c.env, capture_output=True)


# -- the steps -----------------------------------------------------------------------------------------------
def steps(c: Ctx, wanted: Callable[[str], bool]) -> list[Result]:
    out: list[Result] = []
    theta = c.tool == "theta"

    def record(step: str, m: Measure | None, version: str | None = "", repo=None, modified=(), note="",
               redo=(), tree: str | None = None) -> bool:
        if tree is None:
            tree = "n/a" if version == "" else tree_state(c, version, repo, modified)
        if m is not None and not m.ok and not note:
            note = m.stderr.strip().splitlines()[-1][:160] if m.stderr.strip() else ""
        r = Result(step, c.tool, m, tree, note)
        out.append(r)
        print(f"  {c.tool:<6} {step:<26} " + (f"{m.seconds:7.1f}s  cgroup peak {m.cgroup_peak / MiB:6.0f} MiB  "
              f"RSS {m.peak_tree_rss / MiB:5.0f} MiB  {m.status:<16}" if m else f"{'':>57}") + f" tree: {tree}"
              + (f"  ({note})" if note else ""), flush=True)
        if m is not None and (not m.ok or tree not in ("ok", "n/a")):
            repair(c, *redo, repo=repo)
        return m is None or m.ok

    repo = c.repo = new_repo(c.root, c.tool, c.tool, c.env, pattern="model/*.safetensors")
    c.bare = repo.with_name(repo.name + "-remote.git")
    shutil.rmtree(c.bare, ignore_errors=True)
    sh(["git", "init", "-q", "--bare", c.bare], c.root, c.env)
    c.git("remote", "add", "origin", f"file://{c.bare}")
    if theta:
        sh(["git", "theta", "install", "--local"], repo, c.env)

    # -- adds: base, full fine-tune, partial (each also the history the later steps need) ----------------
    for step, version in (("add base", "base"), ("add fine-tune", "finetune"), ("add partial", "partial")):
        c.put(version)
        settle(c)
        if wanted(step):
            m = c.measured(["git", "add", "model"], ["git", "commit", "-q", "-m", version])
            record(step, m, version, redo=[["git", "add", "model"], ["git", "commit", "-q", "-m", version]])
        else:
            c.git("add", "model")
            c.git("commit", "-q", "-m", version)
    # branches for the merges, the rebase and the cherry-pick (unmeasured, no limit); git-lfs cannot merge a
    # checkpoint, so it gets none (their 7.7 GB, pushed and all, would not fit beside the rest on the disk)
    if theta:
        c.git("checkout", "-q", "-b", "ft2", "HEAD~2")
        c.put("finetune2")
        c.git("add", "model")
        c.git("commit", "-q", "-m", "finetune2")
        c.git("checkout", "-q", "-B", "side", "main~1")
        c.put("side")
        c.git("add", "model")
        c.git("commit", "-q", "-m", "side")
        c.git("checkout", "-q", "-f", "main")
        c.git("theta", "checkout", check=False)
        # the operations that are not git commands (zipslice convert/show/diff, theta diff/fsck/squash/export,
        # merge-resolve, get_slice): on this history, before the git steps change it
        llama_ops.steps(c, wanted, lambda step, m, tree, note="": record(step, m, tree=tree, note=note))

    def run(step, cmds, version, modified=(), redo=(), env=None, repo=None, before=None):
        if not wanted(step):
            for cmd in redo or cmds:
                subprocess.run(cmd, cwd=repo or c.repo, env=c.env, capture_output=True)
            if theta:
                subprocess.run(["git", "theta", "checkout"], cwd=repo or c.repo, env=c.env, capture_output=True)
            return
        if before:
            before()
        settle(c, repo)
        m = c.measured(*cmds, repo=repo, env=env)
        record(step, m, version, repo=repo, modified=modified, redo=redo or cmds)

    run("checkout HEAD~1", [["git", "checkout", "-q", "HEAD~1"]], "finetune")
    run("switch main", [["git", "switch", "-q", "main"]], "partial")
    run("reset --hard HEAD~2", [["git", "reset", "-q", "--hard", "HEAD~2"]], "base")
    run("reset --hard ORIG_HEAD", [["git", "reset", "-q", "--hard", "ORIG_HEAD"]], "partial",
        redo=[["git", "reset", "-q", "--hard", "main@{1}"]])
    run("stash", [["git", "stash", "-q"]], "partial", before=lambda: c.put("finetune2", SHARD2),
        redo=[["git", "reset", "-q", "--hard"]])
    # the stash holds shard 2 of finetune2 (unless the step above was skipped: then stash it now)
    if not wanted("stash"):
        c.put("finetune2", SHARD2)
        c.git("stash", "-q")
    mixed = _mixed(c, "partial", "finetune2", SHARD2)
    run("stash pop", [["git", "stash", "pop", "-q"]], mixed, modified=(SHARD2,))
    run("restore", [["git", "restore", "model"]], "partial")

    # -- rebase side onto main (a merge of disjoint groups: theta without numeric work; git-lfs conflicts) ---
    if theta:
        c.git("checkout", "-q", "-f", "side")
        c.git("theta", "checkout", check=False)
        run("rebase side onto main", [["git", "rebase", "-q", "main"]], "rebased",
            redo=[["git", "rebase", "--abort"]])
        c.git("checkout", "-q", "-f", "main")
        c.git("theta", "checkout", check=False)
    else:
        out.append(Result("rebase side onto main", c.tool, None, "n/a", "git-lfs cannot merge a checkpoint"))

    # -- remote: push, clone, then a commit on main (cherry-pick of side) pulled into the clone --------------
    branches = ["main", "side"] if theta else ["main"]
    run("push", [["git", "push", "-q", "origin", *branches]], "")
    c.git("push", "-q", "origin", *branches, check=False)  # (when the step above was skipped)
    c.clone = c.root / f"{c.tool}-clone"
    shutil.rmtree(c.clone, ignore_errors=True)
    if wanted("clone"):
        settle(c)
        m = c.measured(["git", "clone", "-q", f"file://{c.bare}", str(c.clone)], repo=c.root)
        record("clone", m, "partial", repo=c.clone)
    else:
        subprocess.run(["git", "clone", "-q", f"file://{c.bare}", str(c.clone)], cwd=c.root, env=c.env,
                       capture_output=True)
    if theta:
        before = c.git("rev-parse", "HEAD").stdout
        run("cherry-pick side", [["git", "cherry-pick", "side"]], "rebased",
            redo=[["git", "cherry-pick", "--abort"]])
        if c.git("rev-parse", "HEAD").stdout == before:
            out.append(Result("pull (fast-forward)", c.tool, None, "n/a", "not run: the cherry-pick made no commit"))
        else:
            c.git("push", "-q", "origin", "main", check=False)
            run("pull (fast-forward)", [["git", "pull", "-q", "--ff-only", "origin", "main"]], "rebased",
                repo=c.clone)
        c.git("reset", "-q", "--hard", "HEAD~1")
        c.git("theta", "checkout", check=False)
    else:
        for step in ("cherry-pick side", "pull (fast-forward)"):
            out.append(Result(step, c.tool, None, "n/a", "git-lfs cannot merge a checkpoint"))
    shutil.rmtree(c.clone, ignore_errors=True)  # (the disk: the merges below store a dense model each)
    shutil.rmtree(c.bare, ignore_errors=True)
    # with the remote gone, its tracking refs go too: they would tell `git theta prune` (forget_merge) that
    # the pushed commits' blobs are on a server, and the merges' common ancestor could no longer be read
    c.git("remote", "remove", "origin", check=False)

    # -- merges (theta only: git-lfs cannot merge a checkpoint) --------------------------------------------
    for strategy in STRATEGIES if theta else ():
        step = f"merge ({strategy})"
        if not wanted(step):
            continue
        run(step, [["git", "merge", "-q", "--no-edit", "ft2"]], None,
            env={**c.env, "GIT_THETA_MERGE_STRATEGY": strategy}, redo=[["git", "merge", "--abort"]])
        c.git("reset", "-q", "--hard", "main@{1}" if _merged(c) else "HEAD")
        c.git("theta", "checkout", check=False)
        forget_merge(c)
    return out


def forget_merge(c: Ctx) -> None:
    """Let go of an undone merge's blobs (a dense model each: five would not fit on the disk beside the rest):
    no reflog or ORIG_HEAD keeps its commit, then `git theta prune`."""
    c.git("update-ref", "-d", "ORIG_HEAD", check=False)
    c.git("reflog", "expire", "--expire=now", "--all")
    c.git("theta", "prune", check=False)


def _merged(c: Ctx) -> bool:
    return c.git("rev-parse", "-q", "--verify", "HEAD^2", check=False).returncode == 0


def _mixed(c: Ctx, version: str, other: str, path: str) -> str:
    """A pseudo-version: ``version``'s files with ``path`` taken from ``other`` (for the checks)."""
    name = f"{version}+{Path(path).name}@{other}"
    if name not in c.digests:
        c.digests[name] = {**c.expected(version), path: c.expected(other)[path]}
    return name


def floor(c: Ctx, version: str) -> list[Result]:
    """What any tool must at least do: copy the shards (a checkout) and read + hash them (an add)."""
    src = c.version(version)
    dest = c.root / "floor"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    files = [src / n for n in lm.SHARDS]
    cp = run_measured(["cp", *files, dest], c.root, c.env, c.cgroup)
    shutil.rmtree(dest, ignore_errors=True)
    hashed = run_measured(["sha256sum", *files], c.root, c.env, c.cgroup)
    return [Result("cp (checkout floor)", "floor", cp, "n/a"), Result("sha256sum (add floor)", "floor", hashed, "n/a")]


def print_table(results: dict[str, list[Result]], limit: str) -> None:
    tools = [t for t in ("theta", "lfs") if t in results]
    for r in results.get("floor", []):
        print(f"{r.step:<26}{r.m.seconds:8.1f}{r.m.cgroup_peak / MiB:10.0f}{r.m.peak_tree_rss / MiB:9.0f}  "
              f"{r.m.status} (no limit)")
    steps = list(dict.fromkeys(r.step for t in tools for r in results[t]))
    by = {(r.tool, r.step): r for t in tools for r in results[t]}
    print(f"\n{'step':<26}" + "".join(f"{'wall s':>8}{'peak MiB':>10}{'RSS MiB':>9}  {t + ' (' + limit_of(t, limit) + ')':<34}"
                                    for t in tools))
    for step in steps:
        line = f"{step:<26}"
        for t in tools:
            r = by.get((t, step))
            if r is None or r.m is None:
                line += f"{'-':>8}{'-':>10}{'-':>9}  {(r.note if r else 'n/a')[:34]:<34}"
                continue
            line += (f"{r.m.seconds:8.1f}{r.m.cgroup_peak / MiB:10.0f}{r.m.peak_tree_rss / MiB:9.0f}  "
                     f"{(r.m.status + ', tree ' + r.tree)[:34]:<34}")
        print(line)


def limit_of(tool: str, limit: str) -> str:
    return limit if tool == "theta" else "no limit"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--mem-limit", type=float, default=1.0, metavar="GIB", help="theta's memory cgroup (default 1)")
    ap.add_argument("--tools", default="theta,lfs,floor")
    ap.add_argument("--steps", default="", help="comma-separated prefixes of the step names to measure (default all)")
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension of the model times this (default 1)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--keep", action="store_true", help="keep the repositories")
    args = ap.parse_args()
    prefixes = [p.strip() for p in args.steps.split(",") if p.strip()]

    def wanted(step: str) -> bool:
        return not prefixes or any(step.startswith(p) for p in prefixes)

    dims = lm.LLAMA3_8B_4L if args.scale == 1 else lm.LLAMA3_8B_4L.scaled(args.scale)
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    env = git_env(root / "home", pythonpath=True)
    for tool in ("lfs", "theta"):  # both installed globally, as a user has them (a clone runs their filters)
        sh(["git", tool, "install"], root, env)
    data = root / "data"
    print(f"model: {dims.nbytes() / 1e9:.2f} GB, largest tensor {dims.vocab * dims.hidden * 2 / 1e9:.2f} GB, "
          f"under {data}; load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)", flush=True)
    reason = MemCgroup.available()
    if reason:
        raise SystemExit(f"no memory cgroup can be made here: {reason}")
    limit = f"{args.mem_limit:g} GiB"
    results: dict[str, list[Result]] = {}
    for tool in args.tools.split(","):
        cg = MemCgroup(int(args.mem_limit * (1 << 30)) if tool == "theta" else 1 << 62, f"llama-{tool}")
        c = Ctx(root, data, dims, env, tool, cg)
        for v in lm.VERSIONS:
            c.expected(v)
        try:
            print(f"{tool}: every measured command in {cg.path}"
                  + (f" limited to {limit} (page cache included)" if tool == "theta" else " (no limit)"), flush=True)
            results[tool] = floor(c, "base") if tool == "floor" else steps(c, wanted)
        finally:
            cg.close()
            if not args.keep and tool != "floor":
                for suffix in ("", "-remote.git", "-clone"):
                    shutil.rmtree(root / (tool + suffix), ignore_errors=True)
    print(f"\n{dims.nbytes() / 1e9:.2f} GB Llama-3-8B-shaped checkpoint (4 layers, 2 shards); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine)")
    print_table(results, limit)
    ok = check_targets(results)
    if args.json:
        args.json.write_text(json.dumps({t: [{"step": r.step, "seconds": r.m.seconds if r.m else None,
                                              "cgroup_peak": r.m.cgroup_peak if r.m else None,
                                              "rss": r.m.peak_tree_rss if r.m else None,
                                              "status": r.m.status if r.m else None, "tree": r.tree,
                                              "note": r.note} for r in rs] for t, rs in results.items()}, indent=1))
    return 0 if ok else 1


def check_targets(results: dict[str, list[Result]]) -> bool:
    theta = results.get("theta", [])
    ok = all(r.m is None or (r.m.ok and r.tree in ("ok", "n/a")) for r in theta)
    done = sum(1 for r in theta if r.m is not None and r.m.ok and r.tree in ("ok", "n/a"))
    print(f"\ntheta: {done} of {sum(1 for r in theta if r.m is not None)} steps completed with the work tree as "
          "committed")
    lfs = {r.step: r for r in results.get("lfs", [])}
    fl = {r.step: r for r in results.get("floor", [])}
    for r in theta:
        ref = lfs.get(r.step)
        if r.m is None or ref is None or ref.m is None or not r.step.startswith(("add", "checkout", "switch")):
            continue
        ratio = r.m.seconds / ref.m.seconds
        good = ratio <= 1.0
        ok &= good
        print(f"  {r.step:<24} theta / git-lfs {ratio:5.2f}x (target <= 1.0: {'ok' if good else 'MISSED'})")
    cp = fl.get("cp (checkout floor)")
    for r in theta:
        if cp is not None and r.m is not None and r.step.startswith(("checkout", "switch")):
            ratio = r.m.seconds / cp.m.seconds
            good = ratio <= 2.0
            ok &= good
            print(f"  {r.step:<24} theta / cp      {ratio:5.2f}x (target <= 2.0: {'ok' if good else 'MISSED'})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
