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

Baseline = RSS of the child after importing numpy, torch and zipslice (before any file access); peak =
ru_maxrss of the child. Page cache: warm by default (each file is read once first); --cold drops it
before every run (root only; it also slows down everything else running on the machine). Targets checked:
open time within 2x between sizes; open RSS < baseline + 50 MiB; one tensor <= baseline + tensor +
32 MiB; stream <= baseline + 2 x largest tensor + 32 MiB and time <= 1.2 x torch.load(mmap=True).

    python3 scripts/bench_read.py --quick
    python3 scripts/bench_read.py                 # 1 GiB and 8 GiB (needs ~9 GiB free under /tmp)
    python3 scripts/bench_read.py --sizes 0.5,2 --tensor-mib 32 --repeat 3
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
sys.path.insert(0, os.path.dirname(HERE))
MiB = 1 << 20
# contenders that read one tensor at a time; zipslice-mmap is zipslice.load(path, mmap=True)
STREAMERS = ["zipslice", "zipslice-mmap", "torch-mmap"]


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
    print(json.dumps({"base": base, "peak": peak, "open_s": t_open, "total_s": elapsed, "cpu_s": cpu, "check": total}))


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


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def _run(kind: str, op: str, path: str, cold: bool) -> dict:
    if cold:
        _drop_caches()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, op, path],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_runs(kinds, op, path, cold, repeat) -> dict:
    """Median of ``repeat`` runs per contender, the contenders taking turns run after run, so that a
    burst of load from other jobs on the machine does not fall on one contender only."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(repeat):
        for kind in kinds:
            runs[kind].append(_run(kind, op, path, cold))
    return {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}


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
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
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
    cold = args.cold and _drop_caches()
    if args.cold and not cold:
        print("cannot drop the page cache (not root?): warm-cache figures")
    print(f"page cache: {'dropped before every run (cold)' if cold else 'warm (file read once before the runs)'}")
    streamers = STREAMERS + (["zipslice-ra"] if args.read_ahead else [])
    results = {}
    paths = []
    for gib in sizes:
        size = int(gib * (1 << 30))
        path = os.path.join(args.dir, f"ckpt_{gib:g}GiB_{args.tensor_mib}MiB.pt")
        if not os.path.exists(path):
            print(f"generating {path} ...", flush=True)
            _generate(path, size, tensor)
        paths.append(path)
        if not cold:
            _warm(path)
        r = results[gib] = {}
        contenders = ["zipslice", "torch-mmap"] + ([] if args.no_full_load else ["torch"])
        for kind, m in _median_runs(contenders, "open", path, cold, args.repeat).items():
            r[kind, "open"] = m
        for op in ("one", "stream"):
            for kind, m in _median_runs(streamers, op, path, cold, args.repeat).items():
                r[kind, op] = m
        assert r["zipslice", "stream"]["check"] == r["torch-mmap", "stream"]["check"], "different sums!"
        assert r["zipslice-mmap", "stream"]["check"] == r["torch-mmap", "stream"]["check"], "different sums!"

    def mib(x):
        return f"{x / MiB:8.1f}"

    print()
    print(f"tensors of {args.tensor_mib} MiB float32; RSS figures are peak minus the child's baseline after imports")
    print(f"{'size':>6} {'operation':<8} {'contender':<13} {'time s':>8} {'cpu s':>6} {'+RSS MiB':>9}  {'vs zipslice':>12}")
    verdicts = []
    for gib, r in results.items():
        for op in ("open", "one", "stream"):
            z = r["zipslice", op]
            for kind in ("zipslice", "zipslice-ra", "zipslice-mmap", "torch-mmap", "torch"):
                if (kind, op) not in r:
                    continue
                m = r[kind, op]
                t = m["open_s"] if op == "open" else m["total_s"]
                zt = z["open_s"] if op == "open" else z["total_s"]
                extra = max(m["peak"] - m["base"], 0)  # ru_maxrss and psutil's rss may differ by a few pages
                zextra = max(z["peak"] - z["base"], MiB)  # ratios against at least 1 MiB: no absurd x1000000
                ratio = "" if kind == "zipslice" else f"t x{t / zt:6.2f} rss x{extra / zextra:6.1f}"
                print(f"{gib:>5g}G {op:<8} {kind:<13} {t:8.3f} {m['cpu_s']:6.2f} {mib(extra)}  {ratio}")
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
            verdicts.append((f"{gib:g} GiB {kind} stream time <= 1.2 x torch.load(mmap=True)", ratio <= 1.2,
                             f"x{ratio:.2f}"))
        st = r["zipslice-mmap", "stream"]
        verdicts.append((f"{gib:g} GiB zipslice-mmap stream <= baseline + 2 x tensor + 32 MiB",
                         st["peak"] - st["base"] <= 2 * tensor + 32 * MiB, mib(st["peak"] - st["base"]).strip() + " MiB"))
    opens = [results[g]["zipslice", "open"]["open_s"] for g in sizes]
    counts = [max(int(g * (1 << 30)) // tensor, 1) for g in sizes]
    ratio = max(opens) / min(opens)
    verdicts.append((f"open time within 2x between {sizes[0]:g} and {sizes[-1]:g} GiB", ratio <= 2,
                     " / ".join(f"{o * 1000:.1f} ms" for o in opens) + f" (x{ratio:.2f})"))
    # opening costs O(tensors) (the pickle), never O(bytes): the same check per tensor
    per = [o / c for o, c in zip(opens, counts)]
    verdicts.append(("open time per tensor within 2x between sizes", max(per) / min(per) <= 2,
                     " / ".join(f"{p * 1e6:.0f} us ({c} tensors)" for p, c in zip(per, counts))))
    print()
    for what, ok, fig in verdicts:
        print(f"  [{'ok' if ok else 'MISS'}] {what}: {fig}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold": cold, "tensor_mib": args.tensor_mib,
                       "results": {str(g): {f"{k}/{o}": v for (k, o), v in r.items()} for g, r in results.items()},
                       "verdicts": verdicts}, f, indent=1)
    if not args.keep:
        for p in paths:
            os.unlink(p)


if __name__ == "__main__":
    main()
