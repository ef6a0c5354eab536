#!/usr/bin/env python3
"""Benchmark: zipslice's safetensors reader against the safetensors library, side by side.

Generates a safetensors file under /tmp (default 2 GiB of 64 MiB float32 tensors; --quick: 512 MiB),
then, each in its own subprocess, times and measures peak RSS for
  one  -- open the file, read one tensor (the middle one) and touch every element (sum);
  all  -- open the file, read every tensor one at a time, touch it, drop it;
with zipslice (torch tensors and numpy arrays) and safetensors.safe_open (framework "pt" and "np"),
plus safetensors.torch.load_file for "all" (what many users call: it holds the whole file at once).
Timings are the median of --repeat runs with the file in the page cache (one warm-up read first).

    python3 scripts/bench/safetensors_read.py            # 2 GiB
    python3 scripts/bench/safetensors_read.py --quick    # 512 MiB
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

CONTENDERS = {
    "zipslice (torch)": "zs_pt",
    "zipslice (numpy)": "zs_np",
    "safe_open pt": "st_pt",
    "safe_open np": "st_np",
    "load_file pt": "st_load",
}


# -- child side: one contender, one operation, one process ------------------------------------------------

def _child(kind: str, op: str, path: str) -> None:
    import resource

    import numpy as np  # noqa: F401  (imported before measuring the baseline, like torch)
    import psutil
    import torch

    import safetensors
    import safetensors.torch
    import zipslice

    base_rss = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    total = 0.0
    if kind in ("zs_pt", "zs_np"):
        with zipslice.load(path) as lsd:
            keys = list(lsd)
            keys = [keys[len(keys) // 2]] if op == "one" else keys
            for k in keys:
                v = lsd[k] if kind == "zs_pt" else lsd.numpy(k)
                total += float(v.sum())
                del v
    elif kind in ("st_pt", "st_np"):
        with safetensors.safe_open(path, framework="pt" if kind == "st_pt" else "np") as f:
            keys = list(f.keys())
            keys = [keys[len(keys) // 2]] if op == "one" else keys
            for k in keys:
                v = f.get_tensor(k)
                total += float(v.sum())
                del v
    elif kind == "st_load":
        d = safetensors.torch.load_file(path)
        keys = list(d)
        keys = [keys[len(keys) // 2]] if op == "one" else keys
        for k in keys:
            total += float(d[k].sum())
        del d
    else:
        raise SystemExit(f"unknown contender {kind}")
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    json.dump({"seconds": elapsed, "peak_rss": peak, "base_rss": base_rss, "checksum": total,
               "torch": torch.__version__, "safetensors": safetensors.__version__}, sys.stdout)


# -- parent side ------------------------------------------------------------------------------------------

def _generate(path: str, total_bytes: int, tensor_bytes: int) -> None:
    import numpy as np

    import zipslice
    from zipslice.info import TensorSource

    n = total_bytes // tensor_bytes
    elems = tensor_bytes // 4
    rows = 1024
    shape = (rows, elems // rows)

    def make(i: int):
        def read():
            return np.random.default_rng(i).random(elems, dtype=np.float32).data
        return read

    sources = [TensorSource(f"layers.{i:03d}.weight", "float32", shape, make(i)) for i in range(n)]
    t0 = time.perf_counter()
    zipslice.save(path, [(s.name, s) for s in sources], format="safetensors")
    print(f"generated {path}: {n} x {tensor_bytes >> 20} MiB float32 = {os.path.getsize(path) / 2**30:.2f} GiB "
          f"in {time.perf_counter() - t0:.1f} s (streamed by zipslice's writer)", file=sys.stderr)


def _run(kind: str, op: str, path: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, op, path], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 MiB instead of 2 GiB")
    ap.add_argument("--size-mib", type=int, default=None, help="file size in MiB (default 2048, quick 512)")
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--path", default="/tmp/zipslice-bench.safetensors")
    ap.add_argument("--keep", action="store_true", help="keep the generated file")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "OP", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return

    size = (args.size_mib or (512 if args.quick else 2048)) << 20
    want = (size // (args.tensor_mib << 20)) * (args.tensor_mib << 20)
    if not (os.path.exists(args.path) and os.path.getsize(args.path) > want):
        _generate(args.path, size, args.tensor_mib << 20)
    try:
        _run("zs_np", "all", args.path)  # warm the page cache so every contender reads from memory
        results: dict[tuple[str, str], dict] = {}
        for op in ("one", "all"):
            for label, kind in CONTENDERS.items():
                if kind == "st_load" and op == "one":
                    continue
                runs = [_run(kind, op, args.path) for _ in range(args.repeat)]
                sums = {r["checksum"] for r in runs}
                results[(op, label)] = {
                    "seconds": statistics.median(r["seconds"] for r in runs),
                    "peak": max(r["peak_rss"] for r in runs),
                    "over": max(r["peak_rss"] - r["base_rss"] for r in runs),
                    "checksum": sums.pop() if len(sums) == 1 else None,
                }
        meta = runs[0]
    finally:
        if not args.keep:
            os.unlink(args.path)

    print(f"\nsafetensors file: {size / 2**30:.2f} GiB of {args.tensor_mib} MiB float32 tensors; "
          f"median of {args.repeat} runs, warm page cache; torch {meta['torch']}, safetensors {meta['safetensors']}; "
          f"{os.cpu_count()} cores")
    print(f"{'op':4} {'contender':18} {'time s':>8} {'peak RSS MiB':>13} {'RSS over imports MiB':>21} "
          f"{'time vs safe_open pt':>21}")
    for (op, label), r in results.items():
        ref = results[(op, "safe_open pt")]["seconds"]
        print(f"{op:4} {label:18} {r['seconds']:8.3f} {r['peak'] / 2**20:13.0f} {r['over'] / 2**20:21.0f} "
              f"{r['seconds'] / ref:20.2f}x")
    # torch and numpy sum in different orders: compare sums within each framework
    checks = {(op, fw): {r["checksum"] for (o, label), r in results.items()
                         if o == op and (label.endswith("np") or "numpy" in label) == (fw == "np")}
              for op in ("one", "all") for fw in ("pt", "np")}
    same = all(len(v) == 1 and None not in v for v in checks.values())
    print("contenders of one framework computed identical sums:", "yes" if same else f"NO {checks}")


if __name__ == "__main__":
    main()
