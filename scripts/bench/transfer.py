#!/usr/bin/env python3
"""Benchmark: push, clone and pull of the same checkpoint history through a real LFS server at a chosen link
speed, git-lfs and git-theta side by side.

Server and clients run inside a private network namespace (``unshare --net``, root) whose only link is its
loopback; a ``tbf`` qdisc on that loopback sets the rate (``--rates 200mbit``: ``tc qdisc add dev lo root tbf
rate 200mbit burst 256kb latency 100ms``; ``unlimited``: no qdisc). The LFS server is giftless with local
storage (scripts/bench/lfs_server.py; giftless is installed by the test extras), one repository path per tool; git's own
objects move through a file:// remote (the metadata text and pointer files: kilobytes), LFS objects over HTTP
on the link. Bytes are counted on that loopback (``/proc/net/dev`` of the namespace: every byte of both
directions, TCP/IP headers included). ``--rtt MS`` puts a proxy between the clients and the server that adds MS
to every round trip (scripts/bench/latency.py: this kernel has no ``netem``); the rate and the bytes stay those of
the link asked for.

The history is the git benchmark's (scripts/bench/git.py, make_history): v1 a BERT-like float32 checkpoint, v2
every 5th group fine-tuned, v3 a full fine-tune of v2; then v4, a full fine-tune of v3 (the next checkpoint of
continued training). Per tool:

  add v1..v3  `git add` + `git commit` of each version (no link: the figure is the tool's own work)
  push        one `git push` of the three versions (measured)
  clone       a fresh `git clone` that checks out v3 (measured; the file is checked against v3, tensor by tensor)
  push next   v4 committed and pushed
  pull        `git pull` of v4 into the clone (measured; checked against v4)
  stored      the bytes the LFS server holds for the tool after all of it

Tools run step by step in turns (lfs, theta; the order alternates between runs); with --runs N each step's
figures are the medians over the runs, with their spread. The targets (clone <= 0.85x git-lfs's bytes and
<= 0.9x its time at a limited rate, <= 1.0x its time unlimited; pull <= 0.7x; push <= 0.5x) are printed with
each ratio; the exit status is 1 when one is missed (0 with --no-fail).

Without root, ``unshare`` or ``tc`` the benchmark says why and exits 0 (nothing measured).

    python3 scripts/bench/transfer.py                                # 200 Mbit/s, ~310 MiB model, one run
    python3 scripts/bench/transfer.py --rates 200mbit,unlimited --runs 3
    python3 scripts/bench/transfer.py --scale 0.1 --tools theta      # quick look
    python3 scripts/bench/transfer.py --rates unlimited --rtt 50     # a server 50 ms away (a delaying proxy)
    python3 scripts/bench/transfer.py --baseline /path/to/other/checkout  # also that checkout's theta ("theta-base"),
                                                                     # in turns with the others

Large files go under --workdir (default /tmp/theta-bench-transfer).
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
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # harness; this checkout's zipslice (same_tensors reads with it)

from harness import MiB, git_env, run_measured, sh  # noqa: E402
from latency import DelayedServer  # noqa: E402
from lfs_server import GiftlessServer  # noqa: E402

DEFAULT_SCALE = 0.75  # ~310 MiB of float32: the history the issue measured
TBF = "burst 256kb latency 100ms"
COMMITS = ("add v1", "add v2", "add v3")
STEPS = COMMITS + ("push", "clone", "push next", "pull")
# step -> (most x git-lfs's time, most x git-lfs's bytes); the time target of a clone is 1.0 on an unlimited link
TARGETS = {"push": (0.5, None), "clone": (0.9, 0.85), "pull": (0.7, None)}
UNLIMITED_CLONE_TIME = 1.0


# -- the namespace ---------------------------------------------------------------------------------------------
def unavailable() -> str | None:
    """None when a private network namespace with a shaped loopback can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and a tc qdisc)"
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install util-linux iproute2)"
    probe = subprocess.run(["unshare", "--net", "sh", "-c",
                            f"ip link set lo up && tc qdisc add dev lo root tbf rate 100mbit {TBF}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace with a tbf qdisc: {probe.stderr.strip() or probe.returncode}"
    return None


# Through the --rtt proxy every byte crosses the loopback twice (client to proxy, proxy to server): the qdisc's
# rate is doubled and the bytes counted halved, so the link is the one asked for
LEGS = 1


def set_rate(rate: str) -> None:
    """The loopback of this (private) namespace up, shaped to ``rate`` ("unlimited": no qdisc)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # none yet: fine
    if rate != "unlimited":
        number, unit = re.fullmatch(r"([0-9.]+)(\w*)", rate).groups()
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{float(number) * LEGS:g}{unit}",
                        *TBF.split()], check=True)


def link_bytes() -> int:
    """Bytes sent on this namespace's loopback so far (each byte of either direction once)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8]) // LEGS  # transmit bytes
    raise RuntimeError("no loopback in /proc/net/dev")


# -- the history -----------------------------------------------------------------------------------------------
def history(data: Path, scale: float) -> tuple[list[Path], dict]:
    """v1-v3 of scripts/bench/git.py's history, and v4: a full fine-tune of v3 (every float group x(1+1e-3 N))."""
    import numpy as np
    import torch

    from git import make_history

    paths, info = make_history(data, scale)
    v4 = data / f"issue17-s{scale:g}-v3-tuned.pt"
    if not v4.exists():
        rng = np.random.default_rng(4)
        v3 = torch.load(paths[2])
        tuned = OrderedDict()
        for k, t in v3.items():
            x = t.numpy()
            tuned[k] = torch.from_numpy(
                (x * (1 + np.float32(1e-3) * rng.standard_normal(x.shape, dtype=np.float32))).astype(np.float32))
        torch.save(tuned, v4)
    return [paths[0], paths[1], paths[2], v4], info


def alone_bytes(path: Path) -> int:
    """What the checkpoint at ``path`` costs compressed alone: each group one dense blob of theta's codec (the
    issue's measure of the least a clone of that version can fetch)."""
    import zipslice

    from theta.storage import codec

    with zipslice.load(path) as ckpt:
        return sum(len(c) for name in ckpt for c in codec.iter_encode_parts({"values": ckpt.numpy(name)}))


def same_tensors(path: Path, reference: Path) -> bool:
    """Whether the checkpoint at ``path`` holds ``reference``'s tensors bit for bit (read group by group)."""
    import numpy as np
    import zipslice

    try:
        a, b = zipslice.load(path), zipslice.load(reference)
    except Exception:
        return False
    with a, b:
        if list(a) != list(b):
            return False
        return all(np.array_equal(a.numpy(k, raw=True), b.numpy(k, raw=True)) for k in b)


# -- one tool's run --------------------------------------------------------------------------------------------
@dataclass
class Figure:
    seconds: float
    bytes: int
    cpu: float = 0.0
    peak_rss: int = 0
    ok: bool = True


@dataclass
class Run:
    figures: dict = field(default_factory=dict)  # step -> Figure
    stored: int = 0                                 # bytes on the LFS server at the end


def measured(args: list, cwd: Path, env: dict) -> Figure:
    before = link_bytes()
    m = run_measured(args, cwd, env)
    return Figure(m.seconds, link_bytes() - before, m.cpu, m.peak_tree_rss)


class ToolRun:
    """One tool's repositories for one run: an author repository, a bare file:// remote, its path on the LFS
    server, and the clone. Each step is a method, so tools take turns step by step."""

    def __init__(self, tool: str, root: Path, env: dict, server, paths: list[Path], run: int):
        self.tool, self.env, self.paths, self.server = tool, env, paths, server
        self.dir = root / f"{tool}-{run}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.name = f"{tool}-{run}"  # its repository on the LFS server
        self.url = server.lfs_url("bench", self.name)
        self.bare = self.dir / "remote.git"
        sh(["git", "init", "-q", "--bare", self.bare], self.dir, env)
        self.repo = self.dir / "author"
        sh(["git", "init", "-q", self.repo], self.dir, env)
        sh(["git", "remote", "add", "origin", f"file://{self.bare}"], self.repo, env)
        sh(["git", "config", "remote.origin.lfsurl", self.url], self.repo, env)
        if tool == "lfs":
            sh(["git", "lfs", "track", "*.pt"], self.repo, env)
        else:
            sh(["git", "theta", "track", "*.pt"], self.repo, env)
        sh(["git", "add", ".gitattributes"], self.repo, env)
        sh(["git", "commit", "-q", "-m", "attributes"], self.repo, env)
        self.clone_dir = self.dir / "clone"
        self.run = Run()

    def commit(self, i: int) -> None:
        """`git add` + `git commit` of version i+1 (measured: no link involved, the CPU is what differs)."""
        shutil.copyfile(self.paths[i], self.repo / "model.pt")
        time.sleep(1.1)  # no racy-git re-clean of the previous version inside the measured add
        m = run_measured(["git", "add", "model.pt"], self.repo, self.env)
        c = run_measured(["git", "commit", "-q", "-m", f"v{i + 1}"], self.repo, self.env)
        self.run.figures[f"add v{i + 1}"] = Figure(m.seconds + c.seconds, 0, m.cpu + c.cpu,
                                                   max(m.peak_tree_rss, c.peak_tree_rss))

    def commits(self) -> None:
        for i in range(3):
            self.commit(i)

    def push(self) -> None:
        self.run.figures["push"] = measured(["git", "push", "-q", "origin", "main"], self.repo, self.env)

    def clone(self) -> None:
        f = measured(["git", "clone", "-q", "-c", f"remote.origin.lfsurl={self.url}", f"file://{self.bare}",
                      self.clone_dir], self.dir, self.env)
        f.ok = same_tensors(self.clone_dir / "model.pt", self.paths[2])
        self.run.figures["clone"] = f

    def push_next(self) -> None:
        self.commit(3)
        self.run.figures.pop("add v4")  # (measured, not reported: the same kind of add as v3's)
        self.run.figures["push next"] = measured(["git", "push", "-q", "origin", "main"], self.repo, self.env)

    def pull(self) -> None:
        f = measured(["git", "pull", "-q", "--ff-only"], self.clone_dir, self.env)
        f.ok = same_tensors(self.clone_dir / "model.pt", self.paths[3])
        self.run.figures["pull"] = f
        self.run.stored = sum(p.stat().st_size for p in (self.server.storage / "bench" / self.name).rglob("*")
                              if p.is_file())

    def cleanup(self) -> None:
        """Remove the repositories and the tool's objects on the server (what it stored is counted by then)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.server.storage / "bench" / self.name, ignore_errors=True)


# -- reporting ---------------------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    return f" ({min(xs):.1f}-{max(xs):.1f})" if len(xs) > 1 else ""


def report(rate: str, runs: dict[str, list[Run]], raw: int, alone: int) -> list[str]:
    """Print the table of one rate; return the targets missed (by "theta"). ``alone``: the cloned version's bytes
    compressed alone (:func:`alone_bytes`), which each tool's clone is also compared with."""
    tools = list(runs)
    thetas = [t for t in tools if t != "lfs"] if "lfs" in tools else []
    print(f"\n== link: {rate} (median of {max(len(r) for r in runs.values())} run(s), min-max) ==", flush=True)
    print(f"{'step':<10}" + "".join(f"  {t + ' s':>20} {t + ' MiB':>14}" for t in tools)
          + "".join(f"  {t + ' time':>16} {t + ' bytes':>16}" for t in thetas))
    missed = []
    for step in STEPS:
        cells, med = "", {}
        for t in tools:
            figs = [r.figures[step] for r in runs[t] if step in r.figures]
            secs, mib = [f.seconds for f in figs], [f.bytes / MiB for f in figs]
            med[t] = (median(secs), median(mib))
            bad = "" if all(f.ok for f in figs) else " WRONG"
            cells += f"  {median(secs):>7.1f}{spread(secs):>13} {median(mib):>14.0f}{bad}"
            if bad:
                missed.append(f"{rate} {step}: {t}'s checkout is not the committed version")
        line = f"{step:<10}{cells}"
        def ratios(t: str) -> tuple[float, float]:
            return med[t][0] / med["lfs"][0], (med[t][1] / med["lfs"][1]) if med["lfs"][1] else float("nan")

        for t in thetas:
            tr, br = ratios(t)
            line += f"  {tr:>15.2f}x " + (f"{br:>15.2f}x" if br == br else f"{'-':>16}")
        if "theta" in thetas:
            tr, br = ratios("theta")
            want_t, want_b = TARGETS.get(step, (None, None))
            if step == "clone" and rate == "unlimited":
                want_t, want_b = UNLIMITED_CLONE_TIME, None
            goals = []
            if want_t is not None:
                goals.append(f"theta time <= {want_t}x " + ("ok" if tr <= want_t else "MISSED"))
                if tr > want_t:
                    missed.append(f"{rate} {step}: {tr:.2f}x git-lfs's time (target {want_t}x)")
            if want_b is not None:
                goals.append(f"bytes <= {want_b}x " + ("ok" if br <= want_b else "MISSED"))
                if br > want_b:
                    missed.append(f"{rate} {step}: {br:.2f}x git-lfs's bytes (target {want_b}x)")
            line += ("  " + ", ".join(goals)) if goals else ""
        if step == "clone":
            line += "  (x v3 compressed alone: " + ", ".join(f"{t} {med[t][1] * MiB / alone:.3f}" for t in tools) + ")"
        print(line, flush=True)
    cpu = {t: {s: median([r.figures[s].cpu for r in runs[t] if s in r.figures]) for s in STEPS} for t in tools}
    print("CPU seconds of the command's process tree (median): " + "; ".join(
        f"{t} " + ", ".join(f"{s} {cpu[t][s]:.1f}" for s in STEPS) for t in tools), flush=True)
    stored = {t: median([r.stored for r in runs[t]]) for t in tools}
    print("stored on the LFS server: " + ", ".join(f"{t} {stored[t] / MiB:.0f} MiB ({stored[t] / raw:.2f}x one "
                                                    f"version)" for t in tools), flush=True)
    return missed


def inside(args) -> int:
    """The benchmark proper, run inside the private network namespace."""
    global LEGS
    LEGS = 2 if args.rtt else 1
    root = args.workdir
    root.mkdir(parents=True, exist_ok=True)
    env = git_env(root / "home", pythonpath=True)  # measure this checkout's code
    sh(["git", "lfs", "install"], root / "home", env)   # both tools' filters global, as a user has them: a
    sh(["git", "theta", "install"], root / "home", env)  # clone runs them
    if args.threads:
        env["GIT_THETA_THREADS"] = str(args.threads)
    paths, info = history(root / "data", args.scale)
    raw = info["bytes"]
    print(f"checkpoint: {info['groups']} groups, {raw / MiB:.1f} MiB float32; v2 changes {info['changed_groups']} "
          f"groups ({info['changed_bytes'] / MiB:.1f} MiB), v3 fine-tunes v2, v4 fine-tunes v3", flush=True)
    alone = alone_bytes(paths[2])
    print(f"v3 compressed alone (a dense blob per group): {alone / MiB:.1f} MiB, {alone / raw:.3f}x its raw bytes",
          flush=True)
    la = os.getloadavg()
    print(f"load average {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} on {os.cpu_count()} cores", flush=True)
    tools = args.tools.split(",")
    envs = {t: env for t in tools}
    if args.baseline:
        tools.append("theta-base")
        envs["theta-base"] = {**env, "PYTHONPATH": os.pathsep.join(
            p for p in (str(args.baseline.resolve()), os.environ.get("PYTHONPATH", "")) if p)}
    missed, out = [], {}
    for rate in args.rates.split(","):
        set_rate(rate)
        runs: dict[str, list[Run]] = {t: [] for t in tools}
        storage = root / f"lfs-store-{rate}"
        shutil.rmtree(storage, ignore_errors=True)
        with GiftlessServer(storage) as giftless, \
                (DelayedServer(giftless, args.rtt / 1000) if args.rtt else nullcontext(giftless)) as server:
            for n in range(args.runs):
                order = tools[n % len(tools):] + tools[:n % len(tools)]  # each tool first in turn
                current = {t: ToolRun(t, root, envs[t], server, paths, n) for t in order}
                for step in ("commits", "push", "clone", "push_next", "pull"):
                    for t in order:
                        getattr(current[t], step)()
                        for name in (COMMITS if step == "commits" else ()) + (() if step == "commits" else
                                                                               (step.replace("_", " "),)):
                            f = current[t].run.figures[name]
                            print(f"  run {n + 1} {t:>10} {name:<9} {f.seconds:7.2f} s "
                                  f"{f.bytes / MiB:8.1f} MiB cpu {f.cpu:6.1f} s peak {f.peak_rss / MiB:5.0f} MiB"
                                  + ("" if f.ok else "  (checked-out file differs from the committed version)"),
                                  flush=True)
                for t in order:
                    runs[t].append(current[t].run)
                    if not args.keep:
                        current[t].cleanup()
        if not args.keep:
            shutil.rmtree(storage, ignore_errors=True)
        if args.rtt:
            print(f"\n(every LFS request and answer {args.rtt:g} ms later: scripts/bench/latency.py)", flush=True)
        missed += report(rate, runs, raw, alone)
        out[rate] = {t: [{"stored": r.stored, **{s: vars(f) for s, f in r.figures.items()}} for r in rs]
                     for t, rs in runs.items()}
    if args.json:
        args.json.write_text(json.dumps({"raw": raw, "rates": out}, indent=1))
    if missed:
        print("\nmissed: " + "; ".join(missed), flush=True)
    return 1 if missed and not args.no_fail and "lfs" in tools and "theta" in tools else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="200mbit", help="link rates, comma-separated: tc rates (200mbit, 1gbit) "
                    "or 'unlimited' (default 200mbit)")
    ap.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                    help=f"fraction of the git benchmark's BERT-sized model (default {DEFAULT_SCALE}: ~310 MiB)")
    ap.add_argument("--runs", type=int, default=1, help="runs per rate; medians (default 1)")
    ap.add_argument("--tools", default="lfs,theta")
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a worktree of main) whose theta runs "
                    "too, as tool 'theta-base', in turns with the others")
    ap.add_argument("--rtt", type=float, default=0, help="milliseconds added to every round trip to the LFS "
                    "server, by a proxy (scripts/bench/latency.py; default 0)")
    ap.add_argument("--threads", type=int, default=0, help="GIT_THETA_THREADS (default: theta's own choice)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench-transfer"))
    ap.add_argument("--keep", action="store_true", help="keep the repositories and the server's storage")
    ap.add_argument("--json", type=Path, help="also write every figure to this file")
    ap.add_argument("--no-fail", action="store_true", help="exit 0 even when a target is missed")
    ap.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside_namespace:
        return inside(args)
    why = unavailable()
    if why:
        print(f"transfer.py: skipped, nothing measured: {why}", flush=True)
        return 0
    # the namespace lives as long as the child: nothing is left behind, even after kill -9
    return subprocess.run(["unshare", "--net", sys.executable, __file__, "--inside-namespace", *sys.argv[1:]]).returncode


if __name__ == "__main__":
    sys.exit(main())
