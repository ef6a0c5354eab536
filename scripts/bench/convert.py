#!/usr/bin/env python3
"""Benchmark: torch checkpoint -> safetensors, zipslice vs what a user would otherwise run.

Contenders, each in its own subprocess (peak RSS = that process's ru_maxrss):

  zipslice        `zipslice convert SRC DST.safetensors`               (streams one tensor at a time)
  torch+st        torch.load(SRC, weights_only=True) + safetensors.torch.save_file
  torch-mmap+st   torch.load(SRC, mmap=True, weights_only=True) + save_file  (the memory-frugal variant)
  torch+st+fsync  torch+st, then fsync of the output: the durability zipslice's atomic publication gives
  interpreter     python importing torch, safetensors and zipslice, doing nothing (the floor)

The checkpoint is made by torch.save: N GiB of 64 MiB float32 tensors (default 8 GiB; --quick: 1 GiB).
Files go to --dir (default /tmp) and are removed at the end. Before each run the source is read once
(warm page cache, so every contender reads from memory alike) and `sync` flushes earlier writes. Outputs are checked to hold the same tensors.

    python3 scripts/bench/convert.py --quick
    python3 scripts/bench/convert.py            # 8 GiB
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD_PRELUDE = """
import json, resource, sys, time
t0 = time.perf_counter()
"""
_CHILD_REPORT = """
print(json.dumps({"wall": time.perf_counter() - t0,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CONTENDERS = {
    "interpreter": "import torch, safetensors.torch, zipslice.convert, zipslice.cli\n",
    "zipslice": "import sys\nfrom zipslice.cli import main\n"
                "try:\n    main(['convert', sys.argv[1], sys.argv[2]])\nexcept SystemExit as e:\n"
                "    assert not e.code, e.code\n",
    "torch+st": "import torch, safetensors.torch\n"
                "sd = torch.load(sys.argv[1], weights_only=True)\n"
                "safetensors.torch.save_file(sd, sys.argv[2])\n",
    "torch-mmap+st": "import torch, safetensors.torch\n"
                     "sd = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
                     "safetensors.torch.save_file(sd, sys.argv[2])\n",
    # the same durability zipslice gives (it fsyncs before publishing): save_file, then fsync the file
    "torch+st+fsync": "import os, torch, safetensors.torch\n"
                      "sd = torch.load(sys.argv[1], weights_only=True)\n"
                      "safetensors.torch.save_file(sd, sys.argv[2])\n"
                      "fd = os.open(sys.argv[2], os.O_RDONLY)\nos.fsync(fd)\nos.close(fd)\n",
}

_MAKE = """
import sys, torch
n, numel = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
torch.save({f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)}, sys.argv[1])
"""


def mib(n: float) -> str:
    return f"{n / 2 ** 20:,.0f} MiB"


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run(name: str, src: Path, dst: Path) -> dict:
    code = _CHILD_PRELUDE + CONTENDERS[name] + _CHILD_REPORT
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> bool:
    sys.path.insert(0, str(ROOT))
    from zipslice.diff import diff

    rep = diff(a, b)
    return all(t.status == "same" for t in rep.tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0, help="checkpoint size in GiB (default 8)")
    ap.add_argument("--quick", action="store_true", help="1 GiB checkpoint")
    ap.add_argument("--tensor-mib", type=int, default=64, help="size of each float32 tensor (default 64 MiB)")
    ap.add_argument("--dir", default="/tmp", help="where the big files go (default /tmp)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per contender; the fastest is kept")
    ap.add_argument("--skip", action="append", default=[], help="contender to skip (repeatable)")
    ap.add_argument("--src", help="use this existing torch checkpoint instead of generating one (kept)")
    args = ap.parse_args()
    gib = 1.0 if args.quick else args.gib
    tensor_bytes = args.tensor_mib << 20
    n = max(1, int(gib * 2 ** 30) // tensor_bytes)
    work = Path(tempfile.mkdtemp(prefix="zipslice-bench-", dir=args.dir))
    try:
        if args.src:
            src = Path(args.src)
            print(f"checkpoint: {src} ({mib(src.stat().st_size)})")
        else:
            src = work / "model.pt"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", _MAKE, str(src), str(n), str(tensor_bytes // 4)], check=True)
            print(f"checkpoint: {n} x {args.tensor_mib} MiB float32 = {mib(src.stat().st_size)} "
                  f"(torch.save, {time.perf_counter() - t0:.1f} s) in {work}")
        names = [n for n in CONTENDERS if n not in args.skip]
        walls: dict[str, list[float]] = {n: [] for n in names}
        results: dict[str, dict] = {}
        zs_out = work / "zipslice.safetensors"
        for rnd in range(args.repeat):  # round-robin, so slow drifts of the disk hit every contender alike
            for name in names:
                dst = work / f"{name.replace('+', '_')}.safetensors"
                warm(src)
                os.sync()  # no contender pays for another's (or the generator's) write-back
                r = run(name, src, dst)
                walls[name].append(r["wall"])
                if name not in results or r["wall"] < results[name]["wall"]:
                    results[name] = r
                if name == "interpreter":
                    continue
                print(f"  round {rnd + 1} {name:14s} wall {r['wall']:7.2f} s   peak RSS {mib(r['peak']):>10s}",
                      flush=True)
                if name != "zipslice" and zs_out.exists():
                    if not same_tensors(zs_out, dst):
                        print(f"  {name}: output differs from zipslice's!")
                        return 1
                    dst.unlink()
        print("\nbest of", args.repeat, "(every run in brackets):")
        for name in names:
            if name != "interpreter":
                runs = ", ".join(f"{w:.1f}" for w in walls[name])
                print(f"  {name:14s} wall {results[name]['wall']:7.2f} s [{runs}]   "
                      f"peak RSS {mib(results[name]['peak']):>10s}")
        if "zipslice" in names and len(names) > 2:
            print("  every contender's output holds the same tensors as zipslice's (checked with zipslice.diff)")
        floor = results.get("interpreter", {}).get("peak", 0)
        print(f"  {'interpreter':14s} peak RSS {mib(floor)} (imports only)")
        if "zipslice" in results:
            z = results["zipslice"]
            # tensors stream frame by frame (zipslice.frames): the bound does not grow with the tensor
            budget = floor + (100 << 20)
            print(f"zipslice peak RSS {mib(z['peak'])}; budget interpreter + 100 MiB = {mib(budget)}: "
                  f"{'OK' if z['peak'] <= budget else 'OVER'}")
            for name in ("torch+st", "torch-mmap+st", "torch+st+fsync"):
                if name in results:
                    b = results[name]
                    print(f"vs {name:14s}: best-time ratio {z['wall'] / b['wall']:.2f}x "
                          f"({'no worse' if z['wall'] <= b['wall'] * 1.05 else 'SLOWER'}), "
                          f"peak RSS ratio {z['peak'] / b['peak']:.3f}x ({mib(b['peak'])} -> {mib(z['peak'])})")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
