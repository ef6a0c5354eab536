#!/usr/bin/env python3
"""Benchmark: the same checkpoint history under plain git-lfs and under git-theta, side by side.

History (fp32, random normal * 0.02, saved with torch.save):
  commit 1  a transformer-like checkpoint (~340 MiB: 12 layers x (q,k,v,o 768x768, fc1/fc2 768x3072, biases,
            2 layer norms) + embeddings + final norm, ~150 groups)
  commit 2  ~25% of the groups changed (the four attention matrices of 4 layers + the layer norms of half the
            layers: ~11% of bytes)
  commit 3  a full fine-tune: every float group + small noise
  checkout  of commit 1 (after letting the index settle: no racy-git re-clean inside the measurement)
For each step: wall time of `git add` + `git commit` (or `git checkout`), stored bytes (.git/objects +
.git/lfs/objects) and peak RSS of the git process tree (psutil polling every 20 ms: the sum over the tree and the
largest single process), then ratios theta / git-lfs.

    python3 scripts/bench_git.py              # ~340 MiB history (a few minutes)
    python3 scripts/bench_git.py --big        # 4 GiB checkpoint of 64 MiB groups: theta add + checkout peak RSS
    python3 scripts/bench_git.py --scale 0.25 # smaller history (quick look)

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
@dataclass
class Measure:
    seconds: float
    peak_tree_rss: int
    peak_proc_rss: int
    peak_proc_name: str
    cpu: float = 0.0  # user + system seconds of the whole process tree (robust on a busy machine)
    peak_filter_rss: int = 0  # the largest git-theta / git-lfs helper process (not git itself)


def run_measured(args: list[str], cwd: Path, env: dict) -> Measure:
    """Run a command; poll the RSS of its whole process tree every 20 ms."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = psutil.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {cwd}:\n{err.decode(errors='replace')}")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return Measure(elapsed, peak["tree"], peak["proc"], peak["name"], cpu, peak["filter"])


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
def git_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_TERMINAL_PROMPT": "0", "XDG_CONFIG_HOME": str(home / ".config")})
    # git-theta straight from the interpreter's bin directory, as in a virtualenv (a pyenv shim adds ~0.4 s)
    own = Path(sys.executable).parent
    if (own / "git-theta").exists():
        env["PATH"] = str(own) + os.pathsep + env.get("PATH", "")
    return env


def sh(args, cwd, env):
    subprocess.run(args, cwd=cwd, env=env, check=True, capture_output=True)


def setup_repo(root: Path, tool: str, env: dict) -> Path:
    repo = root / tool
    if repo.exists():
        shutil.rmtree(repo)
    sh(["git", "init", "-q", str(repo)], root, env)
    sh(["git", "config", "user.name", "bench"], repo, env)
    sh(["git", "config", "user.email", "bench@example.com"], repo, env)
    if tool == "lfs":
        sh(["git", "lfs", "install", "--local"], repo, env)
        sh(["git", "lfs", "track", "*.pt"], repo, env)
    else:
        sh(["git", "theta", "install", "--local"], repo, env)
        sh(["git", "theta", "track", "*.pt"], repo, env)
    sh(["git", "add", ".gitattributes"], repo, env)
    sh(["git", "commit", "-q", "-m", "attributes"], repo, env)
    return repo


def commit_version(repo: Path, src: Path, msg: str, env: dict) -> Measure:
    shutil.copyfile(src, repo / "model.pt")
    m = run_measured(["git", "add", "model.pt"], repo, env)
    c = run_measured(["git", "commit", "-q", "-m", msg], repo, env)
    return Measure(m.seconds + c.seconds, max(m.peak_tree_rss, c.peak_tree_rss), max(m.peak_proc_rss, c.peak_proc_rss),
                   m.peak_proc_name if m.peak_proc_rss >= c.peak_proc_rss else c.peak_proc_name, m.cpu + c.cpu,
                   max(m.peak_filter_rss, c.peak_filter_rss))


def run_history(root: Path, paths: list[Path], tool: str, env: dict) -> list[tuple[str, Measure, int]]:
    repo = setup_repo(root, tool, env)
    rows = []
    base = stored_bytes(repo)
    for i, p in enumerate(paths, 1):
        m = commit_version(repo, p, f"v{i}", env)
        rows.append((f"add+commit v{i}", m, stored_bytes(repo) - base))
    first = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], cwd=repo, env=env, capture_output=True,
                           text=True, check=True).stdout.split()[1]
    # "Racy git": a file written in the same second as the index is re-cleaned by git at the next refresh,
    # i.e. inside the measured checkout, at random (whether the add crossed a second boundary). Settle it
    # first, unmeasured and the same for both tools, so the checkout measures the checkout.
    time.sleep(1.1)
    sh(["git", "update-index", "-q", "--really-refresh"], repo, env)
    m = run_measured(["git", "checkout", "-q", first], repo, env)
    rows.append(("checkout v1", m, stored_bytes(repo) - base))
    return rows


def fmt_mib(n: int) -> str:
    return f"{n / MiB:8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 12-layer model (default 1)")
    ap.add_argument("--big", action="store_true", help="4 GiB checkpoint of 64 MiB groups: theta peak RSS only")
    ap.add_argument("--big-gib", type=float, default=4.0)
    ap.add_argument("--keep", action="store_true", help="keep the scratch repositories")
    args = ap.parse_args()
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    home.mkdir(exist_ok=True)
    env = git_env(home)

    if args.big:
        return big(root, args.big_gib, env)

    print(f"making the history under {root} ...", flush=True)
    paths, info = make_history(root / "data", args.scale)
    raw = info["bytes"]
    print(f"checkpoint: {info['groups']} groups, {raw / MiB:.1f} MiB fp32; commit 2 changes "
          f"{info['changed_groups']} groups ({info['changed_groups'] / info['groups']:.0%}), "
          f"{info['changed_bytes'] / MiB:.1f} MiB ({info['changed_bytes'] / raw:.0%} of bytes); commit 3 changes all")
    results = {}
    for tool in ("lfs", "theta"):
        print(f"running {tool} ...", flush=True)
        results[tool] = run_history(root, paths, tool, env)

    print()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times suffer "
          "when it exceeds the core count; CPU seconds do not)")
    print(f"{'step':<16}{'wall s lfs':>11}{'theta':>7}{'ratio':>7}  {'CPU s lfs':>10}{'theta':>7}{'ratio':>7}  "
          f"{'stored MiB lfs':>15}{'theta':>8}{'ratio':>7}  {'peak RSS MiB: tree lfs':>22}{'theta':>7}"
          f"{'filter lfs':>11}{'theta':>7}")
    for (step, ml, sl), (_, mt, st) in zip(results["lfs"], results["theta"]):
        print(f"{step:<16}{ml.seconds:11.2f}{mt.seconds:7.2f}{mt.seconds / ml.seconds:7.2f}  "
              f"{ml.cpu:10.2f}{mt.cpu:7.2f}{mt.cpu / max(ml.cpu, 1e-3):7.2f}  "
              f"{sl / MiB:15.1f}{st / MiB:8.1f}{st / max(sl, 1):7.2f}  "
              f"{ml.peak_tree_rss / MiB:22.1f}{mt.peak_tree_rss / MiB:7.1f}"
              f"{ml.peak_filter_rss / MiB:11.1f}{mt.peak_filter_rss / MiB:7.1f}")
    lfs, th = results["lfs"], results["theta"]
    largest = max(3072 * 768, int(4096 * args.scale) * 768) * 4
    first_stored = th[0][2]
    print()
    print("targets:")
    checks = [
        ("full add (v1) <= 1.5x git-lfs", th[0][1].seconds / lfs[0][1].seconds, 1.5),
        ("partial add (v2) <= 0.5x git-lfs", th[1][1].seconds / lfs[1][1].seconds, 0.5),
        ("checkout <= 1.5x git-lfs", th[3][1].seconds / lfs[3][1].seconds, 1.5),
        ("first commit stored <= 0.9x raw fp32", first_stored / raw, 0.9),
    ]
    for name, value, limit in checks:
        print(f"  {name:<40} {value:6.2f}  {'ok' if value <= limit else 'MISSED'}")
    peak = max(m.peak_filter_rss for _, m, _ in th)
    limit = 2 * largest + 150 * MiB
    print(f"  {'peak RSS of the theta filter <= 2x largest group + 150 MiB':<54} {peak / MiB:.0f} MiB "
          f"(limit {limit / MiB:.0f}) {'ok' if peak <= limit else 'MISSED'}")
    git_peak = max(m.peak_proc_rss for _, m, _ in th[3:])
    print(f"  (git itself holds a filter's whole output in memory at checkout, for git-lfs too: "
          f"{git_peak / MiB:.0f} MiB here)")
    unchanged_cost = th[1][2] - th[0][2]
    print(f"  commit 2 stored {unchanged_cost / MiB:.1f} MiB for {info['changed_bytes'] / MiB:.1f} MiB of changed "
          f"groups (unchanged groups cost 0)")
    spool(root, paths[0], env)
    if not args.keep:
        for tool in ("lfs", "theta"):
            shutil.rmtree(root / tool, ignore_errors=True)
    return 0


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
    repo = setup_repo(root, "theta-big", env)
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
