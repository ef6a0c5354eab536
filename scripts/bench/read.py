#!/usr/bin/env python3
"""Benchmark: zipslice's torch reader against torch.load(mmap=True) and torch.load, side by side.

Generates torch zip checkpoints of float32 tensors under /tmp (default 1 GiB and 8 GiB of 64 MiB
tensors; --quick: 256 MiB and 1 GiB), then measures, each contender in its own subprocess:

  open    -- time to open (zipslice.load / torch.load) and peak RSS;
  one     -- open and read one tensor (the middle one), touch it (sum): peak RSS;
  stream  -- open and read every tensor one at a time, touch it (sum), drop it: time and peak RSS.

Contenders: zipslice (default: positioned reads into reused buffers), zipslice-ra (--read-ahead: the same
with the next tensor read ahead on a thread), zipslice-mmap
(zipslice.load(path, mmap=True)), torch.load(mmap=True), and for "open" plain torch.load. Every one
touches the same data the same way (a sum per tensor); cpu s = user + system time of the child.
preadv-floor (stream only) is no reader at all: one bare os.preadv per tensor into a single reused buffer
(mapped when the clock starts, so its first touch counts, as it does for any reader that returns memory
of its own), then the same sum -- the least any positioned read can cost, so "floor / torch-mmap" says
whether a copy out of the page cache can meet the time target on this machine.

Opening is measured twice per file: the first open in a fresh process (what a CLI run or a git filter
pays, including the one-time discovery of format plugins) and the median of 20 further opens in the
same process (the parse alone). Besides the files of 64 MiB tensors (8x the data = 8x the tensors), the
largest size is also written as the smallest one's tensor count of bigger tensors, so that open time is
compared at 8x the data with the same pickle.

--mem-limit GIB runs every child in a memory cgroup of that size (root only), page cache included: a
machine with less RAM than the checkpoint, the case zipslice exists for. Under it nothing stays cached
from one pass to the next, so it implies --cold.

Baseline = RSS of the child after importing numpy, torch and zipslice (before any file access); peak =
ru_maxrss of the child. Page cache: warm by default (the file is read right before every run); --cold evicts the
checkpoint's own pages before every run (posix_fadvise DONTNEED after a sync; no root needed, and the
interpreter's and torch's libraries stay cached as on a machine in use). Targets checked:
open time within 2x between sizes; open RSS < baseline + 50 MiB; one tensor <= baseline + tensor +
32 MiB; stream <= baseline + 2 x largest tensor + 32 MiB and time <= 1.2 x torch.load(mmap=True).

    python3 scripts/bench/read.py --quick
    python3 scripts/bench/read.py                 # 1 GiB and 8 GiB (needs ~9 GiB free under /tmp)
    python3 scripts/bench/read.py --sizes 0.5,2 --tensor-mib 32 --repeat 3
    python3 scripts/bench/read.py --sizes 1,8 --no-full-load --repeat 5 --cold   # page cache evicted
    python3 scripts/bench/read.py --sizes 1,8 --no-full-load --repeat 3 --mem-limit 4   # 8 GiB > "RAM"
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from harness import MemCgroup  # noqa: E402
from zipslice import pagecache  # noqa: E402  (the checkout's zipslice, as the children use)
MiB = 1 << 20
# contenders that read one tensor at a time; zipslice-mmap is zipslice.load(path, mmap=True)
STREAMERS = ["zipslice", "zipslice-mmap", "torch-mmap"]
REOPENS = 20


# -- child: one contender, one operation, one process ------------------------------------------------

def _child(kind: str, op: str, path: str) -> None:
    import resource

    import numpy as np  # noqa: F401  imported before the baseline, like torch
    import psutil
    import torch

    import zipslice
    import zipslice.torch_reader  # noqa: F401  (load() imports it lazily; count it in the baseline)

    base = psutil.Process().memory_info().rss
    total = 0.0
    t_again = None
    if kind == "preadv-floor":
        _floor_child(path, base)
        return
    t0 = time.perf_counter()
    c0 = os.times()
    if kind.startswith("zipslice"):
        # zipslice-ra: the default positioned read with the read-ahead thread turned on (off by default)
        zipslice.torch_reader.TorchCheckpoint.read_ahead = kind == "zipslice-ra"
        lsd = zipslice.load(path, mmap=(kind == "zipslice-mmap"))
        t_open = time.perf_counter() - t0
        keys = list(lsd)
        if op != "open":
            for k in ([keys[len(keys) // 2]] if op == "one" else keys):
                t = lsd[k]
                total += float(t.sum())
                del t
        lsd.close()
    else:
        sd = torch.load(path, weights_only=True, mmap=(kind == "torch-mmap"))
        t_open = time.perf_counter() - t0
        keys = list(sd)
        if op != "open":
            for k in ([keys[len(keys) // 2]] if op == "one" else keys):
                total += float(sd[k].sum())
        del sd
    elapsed = time.perf_counter() - t0
    c1 = os.times()
    cpu = c1.user - c0.user + c1.system - c0.system
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if op == "open" and kind.startswith("zipslice"):
        t_again = _reopen(lambda: zipslice.load(path).close())
    elif op == "open" and kind == "torch-mmap":
        t_again = _reopen(lambda: torch.load(path, weights_only=True, mmap=True))
    print(json.dumps({"base": base, "peak": peak, "open_s": t_open, "total_s": elapsed, "cpu_s": cpu, "check": total,
                      "again_s": t_again if t_again is not None else t_open}))


def _reopen(open_once) -> float:
    """Median time of REOPENS further opens of the same file in this process (the parse alone)."""
    times = []
    for _ in range(REOPENS):
        t = time.perf_counter()
        open_once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _floor_child(path: str, base: int) -> None:
    """preadv-floor: each tensor's bytes with one bare os.preadv into one reused buffer, then the sum."""
    import mmap
    import resource

    import torch

    import zipslice

    with zipslice.load(path) as lsd:
        spans = [(i.offset, i.span_nbytes) for i in lsd.infos()]
    largest = max(n for _, n in spans)
    fd = os.open(path, os.O_RDONLY)
    total = 0.0
    t0 = time.perf_counter()
    c0 = os.times()
    buf = mmap.mmap(-1, largest, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    whole = torch.frombuffer(buf, dtype=torch.float32)
    for offset, n in spans:
        got = 0
        while got < n:
            got += os.preadv(fd, [view[got:n]], offset + got)
        total += float(whole[: n // 4].sum())
    elapsed = time.perf_counter() - t0
    c1 = os.times()
    os.close(fd)
    del whole
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "open_s": 0.0, "total_s": elapsed, "again_s": 0.0,
                      "cpu_s": c1.user - c0.user + c1.system - c0.system, "check": total}))


# -- parent ----------------------------------------------------------------------------------------

def _generate(path: str, size_bytes: int, tensor_bytes: int) -> None:
    """Write the checkpoint in a child so the parent never holds it."""
    code = f"""
import torch
n = {size_bytes} // {tensor_bytes}
g = torch.Generator().manual_seed(0)
sd = {{f"layer{{i:04d}}.weight": torch.empty({tensor_bytes} // 4).uniform_(generator=g) for i in range(n)}}
torch.save(sd, {path!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def _evict(path: str) -> None:
    """Drop this file's pages from the page cache (clean pages only, hence the sync first)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        pagecache.drop(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


# --mem-limit: every child runs in this memory cgroup, whose limit covers its page cache too
_CGROUP = None  # a harness.MemCgroup


def _run(kind: str, op: str, path: str, cold: bool) -> dict:
    # warm (or evict) right before every run: the VM this was built on reclaims idle page cache within a
    # minute or two (DAMON), so a file warmed once at the start is partly cold later on
    if cold:
        _evict(path)
    else:
        _warm(path)
    child = _CGROUP.child() if _CGROUP else None
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, op, path],
                             check=True, capture_output=True, text=True,
                             preexec_fn=(lambda: (child / "cgroup.procs").write_text(str(os.getpid())))
                             if child else None)
    finally:
        if child:
            _CGROUP.remove(child)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_runs(kinds, op, path, cold, repeat) -> dict:
    """Median of ``repeat`` runs per contender, the contenders taking turns run after run (starting with
    a different one each round), so that a burst of load from other jobs on the machine does not fall on
    one contender only."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(repeat):
        # a different contender goes first each round: what ran just before (and what the page cache, or
        # a VM host's cache, kept of it) must not always favour the same one
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            runs[kind].append(_run(kind, op, path, cold))
    return {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}


def _verdict_open(label: str, small: dict, large: dict, what: str) -> list[tuple[str, bool, str]]:
    out = []
    for key, when in (("open_s", "first open in a fresh process"), ("again_s", "open again in the same process")):
        a, b = small[key], large[key]
        ratio = max(a, b) / min(a, b)
        out.append((f"open time within 2x, {label} -- {when}", ratio <= 2,
                    f"{a * 1000:.2f} ms / {b * 1000:.2f} ms (x{ratio:.2f}); {what}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="256 MiB and 1 GiB")
    ap.add_argument("--sizes", default="1,8", help="checkpoint sizes in GiB, comma separated (default 1,8)")
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/zipslice-bench-read")
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement (median; contenders interleaved)")
    ap.add_argument("--no-full-load", action="store_true", help="skip plain torch.load (it holds the whole file)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--cold", action="store_true",
                    help="evict the checkpoint from the page cache before every run (posix_fadvise DONTNEED)")
    ap.add_argument("--mem-limit", type=float, metavar="GIB",
                    help="run every contender in a memory cgroup of this many GiB (page cache included): a "
                         "machine with less RAM than the checkpoint. Root only; implies --cold")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--read-ahead", action="store_true",
                    help="also run zipslice-ra: the default read with the read-ahead thread on (A/B)")
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return

    sizes = [0.25, 1.0] if args.quick else [float(s) for s in args.sizes.split(",")]
    tensor = args.tensor_mib * MiB
    os.makedirs(args.dir, exist_ok=True)
    global _CGROUP
    if args.mem_limit:
        why = MemCgroup.available()
        if why:
            raise SystemExit(f"--mem-limit: {why}")
        _CGROUP = MemCgroup(int(args.mem_limit * (1 << 30)), "bench-read")
        args.cold = True  # a warm-up read could not stay cached anyway
        print(f"every run in memory cgroup {_CGROUP.path} limited to {args.mem_limit:g} GiB (page cache included)")
    cold = args.cold and hasattr(os, "posix_fadvise")
    if args.cold and not cold:
        print("cannot evict pages here (no posix_fadvise): warm-cache figures")
    print(f"page cache: {'checkpoint evicted before every run (cold)' if cold else 'warm (file read right before every run)'}")
    streamers = STREAMERS + (["zipslice-ra"] if args.read_ahead else []) + ["preadv-floor"]
    open_contenders = ["zipslice", "torch-mmap"] + ([] if args.no_full_load else ["torch"])
    results = {}
    paths = []

    def checkpoint(gib: float, tensor_bytes: int) -> str:
        path = os.path.join(args.dir, f"ckpt_{gib:g}GiB_{tensor_bytes // MiB}MiB.pt")
        if not os.path.exists(path):
            print(f"generating {path} ...", flush=True)
            _generate(path, int(gib * (1 << 30)), tensor_bytes)
        paths.append(path)
        return path

    for gib in sizes:
        path = checkpoint(gib, tensor)
        r = results[gib] = {}
        for kind, m in _median_runs(open_contenders, "open", path, cold, args.repeat).items():
            r[kind, "open"] = m
        for op in ("one", "stream"):
            kinds = streamers if op == "stream" else [k for k in streamers if k != "preadv-floor"]
            for kind, m in _median_runs(kinds, op, path, cold, args.repeat).items():
                r[kind, op] = m
        for kind in streamers:
            assert r[kind, "stream"]["check"] == r["torch-mmap", "stream"]["check"], f"different sums: {kind}"
    # the largest size again with the smallest one's tensor count: 8x the data, the same pickle
    count = max(int(sizes[0] * (1 << 30)) // tensor, 1)
    big_tensor = int(sizes[-1] * (1 << 30)) // count
    same_count = None
    if len(sizes) > 1:
        path = checkpoint(sizes[-1], big_tensor)
        same_count = _median_runs(["zipslice", "torch-mmap"], "open", path, cold, args.repeat)

    def mib(x):
        return f"{x / MiB:8.1f}"

    print()
    print(f"tensors of {args.tensor_mib} MiB float32; RSS figures are peak minus the child's baseline after imports;")
    print("open: first open in a fresh process (in brackets: median of further opens in the same process)")
    print(f"{'size':>6} {'operation':<8} {'contender':<13} {'time s':>8} {'cpu s':>6} {'+RSS MiB':>9}  {'vs zipslice':>12}")
    verdicts = []
    for gib, r in results.items():
        for op in ("open", "one", "stream"):
            z = r["zipslice", op]
            for kind in ("zipslice", "zipslice-ra", "zipslice-mmap", "torch-mmap", "torch", "preadv-floor"):
                if (kind, op) not in r:
                    continue
                m = r[kind, op]
                t = m["open_s"] if op == "open" else m["total_s"]
                zt = z["open_s"] if op == "open" else z["total_s"]
                extra = max(m["peak"] - m["base"], 0)  # ru_maxrss and psutil's rss may differ by a few pages
                zextra = max(z["peak"] - z["base"], MiB)  # ratios against at least 1 MiB: no absurd x1000000
                ratio = "" if kind == "zipslice" else f"t x{t / zt:6.2f} rss x{extra / zextra:6.1f}"
                again = f" [{m['again_s'] * 1000:.2f} ms]" if op == "open" and "again_s" in m else ""
                print(f"{gib:>5g}G {op:<8} {kind:<13} {t:8.3f} {m['cpu_s']:6.2f} {mib(extra)}  {ratio}{again}")
        z_open = r["zipslice", "open"]
        verdicts.append((f"{gib:g} GiB open RSS < baseline + 50 MiB",
                         z_open["peak"] - z_open["base"] < 50 * MiB, mib(z_open["peak"] - z_open["base"]).strip() + " MiB"))
        one = r["zipslice", "one"]
        verdicts.append((f"{gib:g} GiB one tensor <= baseline + tensor + 32 MiB",
                         one["peak"] - one["base"] <= tensor + 32 * MiB, mib(one["peak"] - one["base"]).strip() + " MiB"))
        st = r["zipslice", "stream"]
        verdicts.append((f"{gib:g} GiB stream <= baseline + 2 x tensor + 32 MiB",
                         st["peak"] - st["base"] <= 2 * tensor + 32 * MiB, mib(st["peak"] - st["base"]).strip() + " MiB"))
        for kind in [s for s in streamers if s != "torch-mmap"]:
            ratio = r[kind, "stream"]["total_s"] / r["torch-mmap", "stream"]["total_s"]
            what = (" (no reader: bare os.preadv + sum, the least a positioned read costs)"
                    if kind == "preadv-floor" else "")
            verdicts.append((f"{gib:g} GiB {kind} stream time <= 1.2 x torch.load(mmap=True){what}", ratio <= 1.2,
                             f"x{ratio:.2f}"))
        st = r["zipslice-mmap", "stream"]
        verdicts.append((f"{gib:g} GiB zipslice-mmap stream <= baseline + 2 x tensor + 32 MiB",
                         st["peak"] - st["base"] <= 2 * tensor + 32 * MiB, mib(st["peak"] - st["base"]).strip() + " MiB"))
    small = results[sizes[0]]["zipslice", "open"]
    if same_count is not None:
        for kind, m in same_count.items():
            print(f"{sizes[-1]:>5g}G {'open':<8} {kind:<13} {m['open_s']:8.3f} {m['cpu_s']:6.2f} "
                  f"{mib(max(m['peak'] - m['base'], 0))}  ({count} tensors of {big_tensor // MiB} MiB) "
                  f"[{m['again_s'] * 1000:.2f} ms]")
        large = same_count["zipslice"]
        verdicts += _verdict_open(f"{sizes[0]:g} vs {sizes[-1]:g} GiB, {count} tensors each ({sizes[-1] / sizes[0]:g}x the data, same pickle)",
                                  small, large, "data size alone")
    counts = [max(int(g * (1 << 30)) // tensor, 1) for g in sizes]
    verdicts += _verdict_open(f"{sizes[0]:g} vs {sizes[-1]:g} GiB of {args.tensor_mib} MiB tensors "
                              f"({counts[0]} vs {counts[-1]} tensors)", small, results[sizes[-1]]["zipslice", "open"],
                              f"per tensor again: " + " / ".join(
                                  f"{results[g]['zipslice', 'open']['again_s'] / c * 1e6:.1f} us"
                                  for g, c in zip(sizes, counts)))
    print()
    for what, ok, fig in verdicts:
        print(f"  [{'ok' if ok else 'MISS'}] {what}: {fig}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold": cold, "tensor_mib": args.tensor_mib,
                       "results": {str(g): {f"{k}/{o}": v for (k, o), v in r.items()} for g, r in results.items()},
                       "same_count_open": same_count, "verdicts": verdicts}, f, indent=1)
    if not args.keep:
        for p in paths:
            os.unlink(p)


if __name__ == "__main__":
    main()
