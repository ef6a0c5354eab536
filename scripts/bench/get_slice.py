#!/usr/bin/env python3
"""Benchmark: reading part of a big tensor. zipslice's get_slice side by side with safetensors' get_slice,
torch.load(mmap=True), and reading the whole tensor then slicing.

Writes one float32 embedding (default 1 GiB: 262144 x 1024; --quick: 256 MiB) as .safetensors and .pt under
/tmp, then, each in its own subprocess (tree peak RSS sampled by scripts/bench/harness.py), opens the file and
takes one slice:

  rows      [1000:1010]      10 rows (40 KiB)
  columns   [:, 0:8]         8 columns of every row (8 MiB, spread over the whole tensor)

Printed per contender: seconds of the slice itself (median of --repeat, file in the page cache), bytes it
brought in -- read through read(2)-like calls (the kernel's rchar, /proc/self/io) plus file pages mapped into
the process (RssFile: how the mmap readers, safetensors and torch, get theirs) --, peak RSS of the process
tree, and the time ratio to safetensors.

    python3 scripts/bench/get_slice.py            # 1 GiB
    python3 scripts/bench/get_slice.py --quick    # 256 MiB
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))

from bench.harness import fmt_mib, run_measured  # noqa: E402

SLICES = {"rows": "np.s_[1000:1010]", "columns": "np.s_[:, 0:8]"}
CONTENDERS = {
    "zipslice get_slice (.safetensors)": ("zs", "st"),
    "safetensors get_slice": ("safe_open", "st"),
    "zipslice get_slice (.pt)": ("zs", "pt"),
    "torch.load(mmap=True) (.pt)": ("torch_mmap", "pt"),
    "zipslice whole tensor, then slice": ("zs_whole", "st"),
}


def _rchar() -> int:
    with open("/proc/self/io", "rb") as f:
        return int(dict(line.split(b": ") for line in f.read().splitlines())[b"rchar"])


def _rss_file() -> int:
    """Bytes of file pages mapped into this process (what an mmap reader pulls in; not counted by rchar)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


def child(kind: str, path: str, index_src: str) -> None:
    """One contender, one slice, in this process; prints {"seconds", "rchar", "nbytes"} as JSON."""
    import numpy as np

    index = eval(index_src, {"np": np})  # our own constant from SLICES, never input
    if kind == "zs":
        import zipslice
        lsd = zipslice.load(path)
        sl = lsd.get_slice("emb", framework="np")
        lsd.dropping_behind()
        m0, r0, t0 = _rss_file(), _rchar(), time.perf_counter()
        out = sl[index]
    elif kind == "zs_whole":
        import zipslice
        lsd = zipslice.load(path)
        lsd.dropping_behind()
        m0, r0, t0 = _rss_file(), _rchar(), time.perf_counter()
        out = np.ascontiguousarray(lsd.numpy("emb")[index])
    elif kind == "safe_open":
        from safetensors import safe_open
        f = safe_open(path, "np")
        sl = f.get_slice("emb")
        m0, r0, t0 = _rss_file(), _rchar(), time.perf_counter()
        out = sl[index]
    elif kind == "torch_mmap":
        import torch
        sd = torch.load(path, mmap=True, weights_only=True)
        m0, r0, t0 = _rss_file(), _rchar(), time.perf_counter()
        out = sd["emb"][index].clone().numpy()  # clone: the bytes are really read (page faults)
    else:
        raise SystemExit(f"unknown contender {kind}")
    float(out.sum())  # touch every element
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rchar": _rchar() - r0, "mapped": max(0, _rss_file() - m0),
                      "nbytes": int(out.nbytes)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/zipslice-bench-get-slice")
    args = ap.parse_args()
    rows = 65536 if args.quick else 262144
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    st, pt = d / f"emb{rows}.safetensors", d / f"emb{rows}.pt"
    if not st.exists() or not pt.exists():
        import numpy as np
        import torch
        from safetensors.torch import save_file
        w = torch.from_numpy(np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32))
        save_file({"emb": w}, st)
        torch.save({"emb": w}, pt)
        del w
    files = {"st": st, "pt": pt}
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"one float32 tensor [{rows}, 1024] = {rows * 4096 / 2**20:.0f} MiB; file in the page cache; "
          f"median of {args.repeat}")
    for file in files.values():  # warm the page cache
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass
    for sname, index_src in SLICES.items():
        print(f"\n{sname} {index_src}")
        print(f"  {'contender':<36} {'slice s':>9} {'read MiB':>9} {'mapped MiB':>11} {'peak RSS MiB':>13} "
              f"{'time vs st':>11}")
        results = {}
        for name, (kind, which) in CONTENDERS.items():
            runs = []
            for _ in range(args.repeat):
                with tempfile.TemporaryFile() as out:
                    m = run_measured([sys.executable, __file__, "--child", kind, files[which], index_src], HERE,
                                     env, stdout=out)
                    out.seek(0)
                    runs.append((json.loads(out.read()), m.peak_tree_rss))
            secs = statistics.median(r[0]["seconds"] for r in runs)
            first = runs[0][0]
            results[name] = (secs, first["rchar"], first["mapped"], max(r[1] for r in runs))
        base = results["safetensors get_slice"]
        for name, (secs, rchar, mapped, rss) in results.items():
            print(f"  {name:<36} {secs:>9.4f} {rchar / 2**20:>9.2f} {mapped / 2**20:>11.2f} {fmt_mib(rss):>13} "
                  f"{secs / base[0]:>10.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
