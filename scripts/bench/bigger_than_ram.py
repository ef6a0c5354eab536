#!/usr/bin/env python3
"""Benchmark (issue #11): models bigger than RAM through git, under git-lfs and git-theta side by side.

(scripts/bench/git.py is the everyday-commit benchmark of issue #17; this one adds memory cgroups, clone,
the --big model and the --sweep of the checkout paths.)

History (fp32, random normal * 0.02, saved with torch.save):
  commit 1  a transformer-like checkpoint (~340 MiB: 12 layers x (q,k,v,o 768x768, fc1/fc2 768x3072, biases,
            2 layer norms) + embeddings + final norm, ~150 groups)
  commit 2  ~25% of the groups changed (the four attention matrices of 4 layers + the layer norms of half the
            layers: ~11% of bytes): the "partial add"
  commit 3  a full fine-tune: every float group + small noise
  checkout  of commit 1 (after letting the index settle: no racy-git re-clean inside the measurement)
  clone     of the history from a file:// remote (git-lfs's standalone transfer), checking out commit 3
For each step: wall time, CPU seconds of the process tree, stored bytes (.git/objects + .git/lfs/objects), peak
RSS of the git process tree (psutil polling every 20 ms: the sum over the tree, the largest process, the
largest filter process), then ratios theta / git-lfs.

--mem-limit GIB runs every git command in a memory cgroup of that size (root; cgroup v2 or v1; page cache
included, as on a machine with that much RAM) and adds, per step, the peak memory of the whole cgroup
(memory.peak / memory.max_usage_in_bytes) and whether the kernel killed a process (OOM).

--big GIB: a checkpoint of 64 MiB groups (issue #11: 3 GiB in 1 GiB): add, partial add (10 groups), checkout
of the first version, switch back, clone -- each tool under --mem-limit, plus git-lfs's checkout of the same
history without a limit, the reference for theta's checkout time under the limit.

--sweep: checkout time of theta's two paths (the checkpoint handed to git vs a placeholder materialized
after git) for models of 4-256 MiB: the measured reason for theta.materializeAbove's default.

    python3 scripts/bench/bigger_than_ram.py                              # ~340 MiB history (a few minutes)
    python3 scripts/bench/bigger_than_ram.py --mem-limit 1                # the same, every git command in 1 GiB
    python3 scripts/bench/bigger_than_ram.py --big 3 --mem-limit 1        # 3 GiB checkpoint in a 1 GiB cgroup
    python3 scripts/bench/bigger_than_ram.py --sweep
    python3 scripts/bench/bigger_than_ram.py --scale 0.25                 # smaller history (quick look)

Large files go under --workdir (default /tmp/theta-bench), never into the repository.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import psutil

MiB = 1 << 20


# -- measuring ---------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))            # this checkout's zipslice and theta
sys.path.append(str(ROOT / "tests"))     # support.memcg: the memory cgroup the tests use too


@dataclass
class Measure:
    seconds: float
    peak_tree_rss: int
    peak_proc_rss: int
    peak_proc_name: str
    cpu: float = 0.0  # user + system seconds of the whole process tree (robust on a busy machine)
    peak_filter_rss: int = 0  # the largest git-theta / git-lfs helper process (not git itself)
    cgroup_peak: int | None = None  # peak memory of the whole cgroup, page cache included (--mem-limit)
    status: str = "ok"  # "ok", "OOM-killed", or "failed (exit N)"
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_measured(args: list[str], cwd: Path, env: dict, cgroup=None, check: bool = True) -> Measure:
    """Run a command (in ``cgroup`` if given); poll the RSS of its whole process tree every 20 ms.

    ``check``: exit on failure; otherwise the failure is the Measure's status (a step that the memory limit
    kills is a result, not an error)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ooms = cgroup.oom_kills() if cgroup is not None else 0
    if cgroup is not None:
        cgroup.reset_peak()
    t0 = time.perf_counter()
    proc = psutil.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        preexec_fn=cgroup.join if cgroup is not None else None)
    peak = {"tree": 0, "proc": 0, "name": "", "filter": 0}
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                procs = [proc] + proc.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            total = 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                total += rss
                if rss > peak["filter"]:
                    try:
                        cmd = " ".join(p.cmdline()[:3])
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        cmd = ""
                    if "theta" in cmd or "git-lfs" in cmd:
                        peak["filter"] = rss
                if rss > peak["proc"]:
                    try:
                        peak["proc"], peak["name"] = rss, " ".join(p.cmdline()[:3])
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        peak["proc"] = rss
            peak["tree"] = max(peak["tree"], total)
            done.wait(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    elapsed = time.perf_counter() - t0
    done.set()
    th.join()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    status = "ok"
    if cgroup is not None and cgroup.oom_kills() > ooms:
        status = "OOM-killed"
    elif proc.returncode != 0:
        status = f"failed (exit {proc.returncode})"
    if status != "ok" and check:
        raise SystemExit(f"{' '.join(args)} {status} in {cwd}:\n{err.decode(errors='replace')}")
    return Measure(elapsed, peak["tree"], peak["proc"], peak["name"], cpu, peak["filter"],
                   cgroup.peak() if cgroup is not None else None, status, err.decode(errors="replace")[-2000:])


def combine(*ms: Measure) -> Measure:
    """Several commands as one step (e.g. add + commit): times add up, peaks take the maximum."""
    big = max(ms, key=lambda m: m.peak_proc_rss)
    bad = next((m for m in ms if not m.ok), None)
    peaks = [m.cgroup_peak for m in ms if m.cgroup_peak is not None]
    return Measure(sum(m.seconds for m in ms), max(m.peak_tree_rss for m in ms), big.peak_proc_rss, big.peak_proc_name,
                   sum(m.cpu for m in ms), max(m.peak_filter_rss for m in ms), max(peaks) if peaks else None,
                   bad.status if bad else "ok", bad.stderr if bad else "")


def dir_bytes(*dirs: Path) -> int:
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    pass
    return total


def stored_bytes(repo: Path) -> int:
    return dir_bytes(repo / ".git" / "objects", repo / ".git" / "lfs" / "objects")


# -- the history -------------------------------------------------------------------------------------------
def make_history(data: Path, scale: float, seed: int = 0) -> tuple[list[Path], dict]:
    import torch

    d, ff, layers = 768, 3072, 12
    vocab = max(64, int(4096 * scale))
    n_layers = max(1, round(layers * scale))
    g = torch.Generator().manual_seed(seed)
    sd: OrderedDict = OrderedDict()
    sd["embed.weight"] = torch.randn(vocab, d, generator=g) * 0.02
    for i in range(n_layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            sd[p + f"attn.{m}.weight"] = torch.randn(d, d, generator=g) * 0.02
            sd[p + f"attn.{m}.bias"] = torch.randn(d, generator=g) * 0.02
        sd[p + "mlp.fc1.weight"] = torch.randn(ff, d, generator=g) * 0.02
        sd[p + "mlp.fc1.bias"] = torch.randn(ff, generator=g) * 0.02
        sd[p + "mlp.fc2.weight"] = torch.randn(d, ff, generator=g) * 0.02
        sd[p + "mlp.fc2.bias"] = torch.randn(d, generator=g) * 0.02
        for ln in ("ln1", "ln2"):
            sd[p + f"{ln}.weight"] = 1 + torch.randn(d, generator=g) * 0.02
            sd[p + f"{ln}.bias"] = torch.randn(d, generator=g) * 0.02
    sd["final_ln.weight"] = torch.ones(d)
    sd["final_ln.bias"] = torch.zeros(d)
    data.mkdir(parents=True, exist_ok=True)
    paths = [data / f"v{i}.pt" for i in (1, 2, 3)]
    torch.save(sd, paths[0])

    v2 = OrderedDict(sd)
    changed = [k for k in sd if ".ln" in k and int(k.split(".")[1]) < (n_layers + 1) // 2]
    changed += [k for k in sd if k.startswith(tuple(f"layers.{i}." for i in range(0, n_layers, 3)))
                and "attn" in k and k.endswith("weight")]
    for k in changed:
        v2[k] = sd[k] + torch.randn(sd[k].shape, generator=g) * 1e-3
    torch.save(v2, paths[1])
    v3 = OrderedDict((k, v + torch.randn(v.shape, generator=g) * 1e-4) for k, v in v2.items())
    torch.save(v3, paths[2])
    total = sum(v.numel() * 4 for v in sd.values())
    info = {"groups": len(sd), "bytes": total, "changed_groups": len(changed),
            "changed_bytes": sum(sd[k].numel() * 4 for k in changed)}
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


# -- the two contenders ------------------------------------------------------------------------------------
TOOLS = ("lfs", "theta")


def git_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_TERMINAL_PROMPT": "0", "XDG_CONFIG_HOME": str(home / ".config")})
    # git-theta straight from the interpreter's bin directory, as in a virtualenv (a pyenv shim adds ~0.4 s)
    own = Path(sys.executable).parent
    if (own / "git-theta").exists():
        env["PATH"] = str(own) + os.pathsep + env.get("PATH", "")
    # this checkout's theta, whatever is installed
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sh(args, cwd, env):
    subprocess.run(args, cwd=cwd, env=env, check=True, capture_output=True)


def install_globally(env: dict) -> None:
    """Both tools' filters in the global config, as a user has them: a clone runs them."""
    home = Path(env["HOME"])
    sh(["git", "config", "--global", "user.name", "bench"], home, env)
    sh(["git", "config", "--global", "user.email", "bench@example.com"], home, env)
    sh(["git", "lfs", "install"], home, env)
    sh(["git", "theta", "install"], home, env)


def setup_repo(root: Path, tool: str, env: dict, name: str | None = None) -> Path:
    """A work repository tracking *.pt with ``tool``, and an empty file:// remote (``origin``)."""
    repo = root / (name or tool)
    bare = root / f"{name or tool}-remote.git"
    for d in (repo, bare):
        if d.exists():
            shutil.rmtree(d)
    sh(["git", "init", "-q", "--bare", str(bare)], root, env)
    sh(["git", "init", "-q", str(repo)], root, env)
    sh(["git", "config", "user.name", "bench"], repo, env)
    sh(["git", "config", "user.email", "bench@example.com"], repo, env)
    sh(["git", "remote", "add", "origin", f"file://{bare}"], repo, env)
    if tool == "lfs":
        sh(["git", "lfs", "install", "--local"], repo, env)
        sh(["git", "lfs", "track", "*.pt"], repo, env)
    else:
        sh(["git", "theta", "install", "--local"], repo, env)
        sh(["git", "theta", "track", "*.pt"], repo, env)
    sh(["git", "add", ".gitattributes"], repo, env)
    sh(["git", "commit", "-q", "-m", "attributes"], repo, env)
    return repo


def commit_version(repo: Path, src: Path, msg: str, env: dict, cgroup=None) -> Measure:
    shutil.copyfile(src, repo / "model.pt")
    m = run_measured(["git", "add", "model.pt"], repo, env, cgroup, check=cgroup is None)
    c = run_measured(["git", "commit", "-q", "-m", msg], repo, env, cgroup, check=cgroup is None)
    return combine(m, c)


def settle(repo: Path, env: dict) -> None:
    """"Racy git": a file written in the same second as the index is re-cleaned by git at the next refresh,
    i.e. inside the next measured command, at random. Settle it first, unmeasured and the same for both
    tools, so a checkout measures the checkout."""
    time.sleep(1.1)
    subprocess.run(["git", "update-index", "-q", "--really-refresh"], cwd=repo, env=env, capture_output=True)


def recover(repo: Path, env: dict, redo: list[str] | None = None) -> str:
    """After a step the memory limit killed: what git left behind; then, without the limit, a usable
    repository in the state the step meant to reach (``redo``), so the next step measures what it says."""
    left = []
    lock = repo / ".git" / "index.lock"
    if lock.exists():
        left.append("index.lock")
        lock.unlink()
    for args in (["git", "reset", "-q", "--hard"], redo):
        if args and subprocess.run(args, cwd=repo, env=env, capture_output=True).returncode != 0:
            left.append(f"`{' '.join(args)}` failed")
    return ", ".join(left)


def clone(root: Path, repo: Path, tool: str, env: dict, cgroup=None) -> Measure:
    sh(["git", "push", "-q", "origin", "--all"], repo, env)
    dest = root / f"{repo.name}-clone"
    if dest.exists():
        shutil.rmtree(dest)
    m = run_measured(["git", "clone", "-q", f"file://{root / (repo.name + '-remote.git')}", str(dest)], root, env,
                     cgroup, check=cgroup is None)
    shutil.rmtree(dest, ignore_errors=True)
    return m


def run_history(root: Path, paths: list[Path], tool: str, env: dict, cgroup=None) -> list[tuple[str, Measure, int]]:
    repo = setup_repo(root, tool, env)
    rows = []
    base = stored_bytes(repo)
    names = ["add v1 (full)", "add v2 (partial)", "add v3 (all)"]
    for i, p in enumerate(paths, 1):
        m = commit_version(repo, p, f"v{i}", env, cgroup)
        rows.append((names[i - 1], m, stored_bytes(repo) - base))
    first = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], cwd=repo, env=env, capture_output=True,
                           text=True, check=True).stdout.split()[1]
    settle(repo, env)
    m = run_measured(["git", "checkout", "-q", first], repo, env, cgroup, check=cgroup is None)
    rows.append(("checkout v1", m, stored_bytes(repo) - base))
    sh(["git", "checkout", "-q", "master" if _has(repo, env, "master") else "main"], repo, env)
    rows.append(("clone", clone(root, repo, tool, env, cgroup), stored_bytes(repo) - base))
    return rows


def checkout_rounds(root: Path, env: dict, cgroup, rounds: int) -> dict[str, Measure]:
    """More checkouts of v1 (and back), the tools taking turns, a different one first each round, so a burst
    of load from other jobs does not fall on one tool only; the median run of each tool."""
    runs: dict[str, list[Measure]] = {t: [] for t in TOOLS}
    for r in range(rounds):
        for tool in (TOOLS if r % 2 == 0 else TOOLS[::-1]):
            repo = root / tool
            branch = "master" if _has(repo, env, "master") else "main"
            first = subprocess.run(["git", "rev-list", "--reverse", branch], cwd=repo, env=env, capture_output=True,
                                   text=True, check=True).stdout.split()[1]
            settle(repo, env)
            runs[tool].append(run_measured(["git", "checkout", "-q", first], repo, env, cgroup, check=cgroup is None))
            sh(["git", "checkout", "-q", branch], repo, env)
    return {t: sorted(ms, key=lambda m: m.seconds)[len(ms) // 2] for t, ms in runs.items()}


def _has(repo: Path, env: dict, branch: str) -> bool:
    return subprocess.run(["git", "rev-parse", "--verify", "-q", branch], cwd=repo, env=env,
                          capture_output=True).returncode == 0


def fmt_mib(n: int) -> str:
    return f"{n / MiB:8.1f}"


def print_table(results: dict[str, list[tuple[str, Measure, int]]], limited: bool) -> None:
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times suffer "
          "when it exceeds the core count; CPU seconds do not)")
    head = (f"{'step':<17}{'wall s lfs':>11}{'theta':>7}{'ratio':>7}  {'CPU s lfs':>10}{'theta':>7}{'ratio':>7}  "
            f"{'stored MiB lfs':>15}{'theta':>8}  {'peak RSS MiB tree lfs':>21}{'theta':>7}")
    if limited:
        head += f"  {'cgroup peak MiB lfs':>19}{'theta':>7}  {'lfs':>10} {'theta':>10}"
    print(head)
    for (step, ml, sl), (_, mt, st) in zip(results["lfs"], results["theta"]):
        line = (f"{step:<17}{ml.seconds:11.2f}{mt.seconds:7.2f}{mt.seconds / ml.seconds:7.2f}  "
                f"{ml.cpu:10.2f}{mt.cpu:7.2f}{mt.cpu / max(ml.cpu, 1e-3):7.2f}  "
                f"{sl / MiB:15.1f}{st / MiB:8.1f}  "
                f"{ml.peak_tree_rss / MiB:21.1f}{mt.peak_tree_rss / MiB:7.1f}")
        if limited:
            line += (f"  {(ml.cgroup_peak or 0) / MiB:19.1f}{(mt.cgroup_peak or 0) / MiB:7.1f}"
                     f"  {ml.status:>10} {mt.status:>10}")
        print(line)


def history(root: Path, args, env: dict) -> int:
    from support.memcg import MemoryCgroup

    print(f"making the history under {root} ...", flush=True)
    paths, info = make_history(root / "data", args.scale)
    raw = info["bytes"]
    print(f"checkpoint: {info['groups']} groups, {raw / MiB:.1f} MiB fp32; commit 2 changes "
          f"{info['changed_groups']} groups ({info['changed_groups'] / info['groups']:.0%}), "
          f"{info['changed_bytes'] / MiB:.1f} MiB ({info['changed_bytes'] / raw:.0%} of bytes); commit 3 changes all")
    cgroup = None
    if args.mem_limit:
        cgroup = MemoryCgroup.create("theta-bench-git", int(args.mem_limit * (1 << 30)))
        print(f"every git command in memory cgroup {cgroup.path} limited to {args.mem_limit:g} GiB "
              "(page cache included)")
    results = {}
    try:
        for tool in TOOLS:
            print(f"running {tool} ...", flush=True)
            results[tool] = run_history(root, paths, tool, env, cgroup)
        if args.repeat > 1:
            print(f"checkout rounds ({args.repeat}, tools alternating) ...", flush=True)
            medians = checkout_rounds(root, env, cgroup, args.repeat)
            for tool in TOOLS:
                rows = results[tool]
                rows[3] = (f"checkout v1 (x{args.repeat})", medians[tool], rows[3][2])
    finally:
        if cgroup is not None:
            cgroup.remove()
    print()
    print_table(results, cgroup is not None)
    lfs, th = results["lfs"], results["theta"]
    print()
    print("targets (issue #11; they are set for the ~300 MiB model without --mem-limit):")
    checks = [
        ("full add (v1) <= 1.0x git-lfs", th[0][1].seconds / lfs[0][1].seconds, 1.0),
        ("partial add (v2) <= 0.3x git-lfs", th[1][1].seconds / lfs[1][1].seconds, 0.3),
        ("checkout <= 1.0x git-lfs", th[3][1].seconds / lfs[3][1].seconds, 1.0),
        ("clone (for reference)", th[4][1].seconds / lfs[4][1].seconds, float("inf")),
    ]
    for name, value, limit in checks:
        verdict = "" if limit == float("inf") else ("ok" if value <= limit else "MISSED")
        print(f"  {name:<40} {value:6.2f}  {verdict}")
    largest = max(3072 * 768, int(4096 * args.scale) * 768) * 4
    peak = max(m.peak_filter_rss for _, m, _ in th)
    limit = 2 * largest + 150 * MiB
    print(f"  {'peak RSS of the theta filter <= 2x largest group + 150 MiB':<54} {peak / MiB:.0f} MiB "
          f"(limit {limit / MiB:.0f}) {'ok' if peak <= limit else 'MISSED'}")
    print(f"  largest process at checkout: git-lfs run {lfs[3][1].peak_proc_rss / MiB:.0f} MiB "
          f"({lfs[3][1].peak_proc_name}), theta run {th[3][1].peak_proc_rss / MiB:.0f} MiB ({th[3][1].peak_proc_name})")
    if not args.keep:
        for tool in TOOLS:
            for d in (tool, f"{tool}-remote.git"):
                shutil.rmtree(root / d, ignore_errors=True)
    return 0


# -- bigger than RAM ----------------------------------------------------------------------------------------
def make_big_version(data: Path, base: Path, gib: float, changed: int) -> Path:
    """``base`` with its first ``changed`` groups replaced (a partial update), written group by group."""
    import dataclasses

    import numpy as np
    import zipslice

    out = data / f"big-{gib:g}g-v2.pt"
    if out.exists():
        return out
    src = zipslice.load(base)
    sources = []
    for i, s in enumerate(src.sources()):
        if i < changed:
            def read(s=s, i=i):
                arr = np.frombuffer(s.read(), dtype=np.float32).copy()
                arr += np.random.default_rng(1000 + i).standard_normal(arr.size, dtype=np.float32) * 1e-3
                return memoryview(arr).cast("B")
            s = dataclasses.replace(s, read=read, tie=None)
        sources.append((s.name, s))
    zipslice.save(out, sources, format="torch")
    return out


def big_steps(root: Path, tool: str, v1: Path, v2: Path, env: dict, cgroup, do_clone: bool) -> list[tuple[str, Measure, str]]:
    """add v1, partial add v2, checkout v1, switch back, clone; after a killed step, what git left behind."""
    repo = setup_repo(root, tool, env, name=f"{tool}-big")
    rows = []

    def step(name, m, redo=None):
        left = recover(repo, env, redo) if not m.ok else ""
        rows.append((name, m, left))
        print(f"  {tool:<5} {name:<18} {m.seconds:7.1f}s  {m.status}" + (f"  (left: {left})" if left else ""),
              flush=True)

    step("add v1", commit_version(repo, v1, "v1", env, cgroup))
    step("add v2 (partial)", commit_version(repo, v2, "v2", env, cgroup))
    settle(repo, env)
    branch = "master" if _has(repo, env, "master") else "main"
    step("checkout v1", run_measured(["git", "checkout", "-q", "HEAD~1"], repo, env, cgroup, check=False),
         redo=["git", "checkout", "-q", "-f", "HEAD~1"])
    settle(repo, env)
    step("switch back", run_measured(["git", "switch", "-q", branch], repo, env, cgroup, check=False),
         redo=["git", "switch", "-q", "-f", branch])
    if do_clone:
        step("clone", clone(root, repo, tool, env, cgroup))
    return rows


def big(root: Path, args, env: dict) -> int:
    from support.memcg import MemoryCgroup

    gib = args.big
    print(f"making a {gib:g} GiB checkpoint of 64 MiB groups under {root} ...", flush=True)
    v1 = make_big(root / "data", gib)
    n_groups = int(gib * 1024 / 64)
    changed = max(1, n_groups // 5)
    v2 = make_big_version(root / "data", v1, gib, changed)
    print(f"v2 changes {changed} of {n_groups} groups")
    cgroup = None
    if args.mem_limit:
        cgroup = MemoryCgroup.create("theta-bench-git", int(args.mem_limit * (1 << 30)))
        print(f"every git command in memory cgroup {cgroup.path} limited to {args.mem_limit:g} GiB")
    results = {}
    reference = None
    try:
        for tool in TOOLS:
            results[tool] = big_steps(root, tool, v1, v2, env, cgroup, not args.no_clone)
            if tool == "lfs":
                repo = root / "lfs-big"
                branch = "master" if _has(repo, env, "master") else "main"
                sh(["git", "switch", "-q", branch], repo, env)
                settle(repo, env)
                reference = run_measured(["git", "checkout", "-q", "HEAD~1"], repo, env)  # no limit
                print(f"  lfs   checkout v1 without a limit {reference.seconds:7.1f}s  (git peak RSS "
                      f"{reference.peak_proc_rss / MiB:.0f} MiB)", flush=True)
            for d in (f"{tool}-big", f"{tool}-big-remote.git"):
                if not args.keep:
                    shutil.rmtree(root / d, ignore_errors=True)
    finally:
        if cgroup is not None:
            cgroup.remove()
    print()
    limit = f"in {args.mem_limit:g} GiB" if args.mem_limit else "no limit"
    print(f"{gib:g} GiB checkpoint, {n_groups} groups of 64 MiB, every git command {limit}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'step':<18}{'lfs s':>8}{'theta s':>9}  {'lfs':<24}{'theta':<12}{'cgroup peak MiB lfs':>20}{'theta':>7}"
          f"{'RSS tree MiB lfs':>17}{'theta':>7}")
    for (name, ml, left_l), (_, mt, left_t) in zip(results["lfs"], results["theta"]):
        sl = ml.status + (f" ({left_l})" if left_l else "")
        st = mt.status + (f" ({left_t})" if left_t else "")
        print(f"{name:<18}{ml.seconds:8.1f}{mt.seconds:9.1f}  {sl:<24}{st:<12}{(ml.cgroup_peak or 0) / MiB:20.0f}"
              f"{(mt.cgroup_peak or 0) / MiB:7.0f}{ml.peak_tree_rss / MiB:17.0f}{mt.peak_tree_rss / MiB:7.0f}")
    th = dict((n, m) for n, m, _ in results["theta"])
    done = sum(m.ok for m in th.values())
    print()
    print(f"theta: {done} of {len(th)} steps completed; git-lfs: {sum(m.ok for _, m, _ in results['lfs'])} of "
          f"{len(results['lfs'])}")
    if reference is not None:
        r = th["checkout v1"].seconds / reference.seconds
        print(f"theta checkout {limit} / git-lfs checkout without a limit: {r:.2f}  "
              f"(target <= 1.0: {'ok' if r <= 1.0 and th['checkout v1'].ok else 'MISSED'})")
    return 0 if done == len(th) else 1


# -- the threshold ------------------------------------------------------------------------------------------
def sweep(root: Path, args, env: dict) -> int:
    """theta's checkout of models of growing size: the checkpoint handed to git (direct) vs a placeholder
    that theta materializes after git (the reason for theta.materializeAbove's default)."""
    import numpy as np
    import zipslice
    from zipslice.info import TensorSource

    print(f"theta checkout (median of {2 * args.repeat}; load {os.getloadavg()[0]:.1f}): the checkout alone, and "
          "with the next `git status` (which re-reads a file git wrote in the same second as its index)")
    print(f"{'size MiB':>8}  {'direct s':>9} {'+status':>8}  {'placeholder s':>13} {'+status':>8}  "
          f"{'ratio':>6} {'+status':>8}")
    for mib in args.sizes:
        repo = setup_repo(root, "theta", env, name=f"sweep-{mib:g}")
        for v in (1, 2):
            n = int(mib * MiB) // 4 // 8  # 8 groups

            def reader(i, v=v):
                def read():
                    rng = np.random.default_rng(100 * v + i)
                    return memoryview(rng.standard_normal(n, dtype=np.float32)).cast("B")
                return read
            srcs = [TensorSource(name=f"w{i}", dtype="float32", shape=(n,), read=reader(i)) for i in range(8)]
            zipslice.save(repo / "model.pt", [(s.name, s) for s in srcs], format="torch")
            sh(["git", "add", "model.pt"], repo, env)
            sh(["git", "commit", "-q", "-m", f"v{v}"], repo, env)
        alone, with_status = {}, {}
        for mode, above in (("direct", "1T"), ("placeholder", "0")):
            e = {**env, "GIT_THETA_MATERIALIZE_ABOVE": above}
            runs, runs_s = [], []
            for _ in range(args.repeat):
                for target in ("HEAD~1", "-"):
                    settle(repo, e)
                    m = run_measured(["git", "checkout", "-q", target], repo, e)
                    s = run_measured(["git", "status", "--porcelain"], repo, e)
                    runs.append(m.seconds)
                    runs_s.append(m.seconds + s.seconds)
            alone[mode], with_status[mode] = _median(runs), _median(runs_s)
        print(f"{mib:8g}  {alone['direct']:9.2f} {with_status['direct']:8.2f}  {alone['placeholder']:13.2f} "
              f"{with_status['placeholder']:8.2f}  {alone['placeholder'] / alone['direct']:6.2f} "
              f"{with_status['placeholder'] / with_status['direct']:8.2f}", flush=True)
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(root / f"sweep-{mib:g}-remote.git", ignore_errors=True)
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 12-layer model (default 1)")
    ap.add_argument("--mem-limit", type=float, metavar="GIB",
                    help="run every git command in a memory cgroup of this many GiB (root; page cache included)")
    ap.add_argument("--big", type=float, metavar="GIB", help="a checkpoint of GIB GiB of 64 MiB groups")
    ap.add_argument("--no-clone", action="store_true", help="--big: skip the clone step (saves disk)")
    ap.add_argument("--sweep", action="store_true", help="theta's direct vs placeholder checkout by model size")
    ap.add_argument("--repeat", type=int, default=3,
                    help="checkout runs per tool (median; tools alternating), and --sweep runs per size and path")
    ap.add_argument("--sizes", type=lambda v: [float(x) for x in v.split(",")], default=[1, 4, 16, 32, 64, 128, 256],
                    help="--sweep: model sizes in MiB (default 1,4,16,32,64,128,256)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch repositories")
    args = ap.parse_args()
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    home.mkdir(exist_ok=True)
    env = git_env(home)
    install_globally(env)
    if args.sweep:
        return sweep(root, args, env)
    if args.big:
        return big(root, args, env)
    return history(root, args, env)


if __name__ == "__main__":
    sys.exit(main())
