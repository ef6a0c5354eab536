#!/usr/bin/env python3
"""Measure theta's storage codec and clean/smudge beside git-lfs.

1. Codec: encode/decode speed and stored/raw ratio of random-normal "trained-like" weights
   (N(0, 0.02), the distribution of a transformer's matrices) in float32 / bfloat16 / float16, per zstd level.
2. clean vs `git lfs clean`, smudge vs `git lfs smudge`, on a transformer-like torch checkpoint written by
   torch.save (and its bf16 copy). Each contender runs in its own subprocess; wall time and peak RSS
   (ru_maxrss of that subprocess) are printed with ratios.

    python3 scripts/bench/codec.py            # ~300 MiB fp32 checkpoint (+ bf16 copy)
    python3 scripts/bench/codec.py --quick    # ~75 MiB
Files go under a temp dir in /tmp and are removed afterwards.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from harness import run_measured  # noqa: E402

def measure(cmd: list[str], cwd: str, stdin: str = "", stdout: str = "") -> dict:
    """The harness's measure of ``cmd`` with stdin/stdout connected to files: wall, CPU, largest process."""
    with open(stdin or os.devnull, "rb") as i, open(stdout or os.devnull, "wb") as o:
        m = run_measured(cmd, Path(cwd), None, stdin=i, stdout=o)
    return {"rc": m.returncode, "wall": m.seconds, "cpu": m.cpu, "rss_mib": m.peak_proc_rss / 2**20}


def codec_table(numel: int, repeats: int) -> None:
    import ml_dtypes

    from theta.base import parallel
    from theta.storage import codec

    x = (np.random.default_rng(0).standard_normal(numel) * 0.02).astype(np.float32)
    print(f"\n## codec: {numel * 4 / 2**20:.0f} MiB of N(0, 0.02) weights, {parallel.CODEC_THREADS} threads, best of {repeats}")
    print(f"{'dtype':10} {'level':>5} {'ratio':>7} {'encode MB/s':>12} {'decode MB/s':>12}")
    for name, arr in (("float32", x), ("bfloat16", x.astype(ml_dtypes.bfloat16)), ("float16", x.astype(np.float16))):
        for level in (0, 1, 3, 6):
            enc, dec = 1e9, 1e9
            for _ in range(repeats):
                t = time.perf_counter()
                blob = codec.encode_array(arr, level)
                enc = min(enc, time.perf_counter() - t)
                t = time.perf_counter()
                back = codec.decode_array(blob)
                dec = min(dec, time.perf_counter() - t)
            assert back.tobytes() == arr.tobytes()
            print(f"{name:10} {level:>5} {len(blob) / arr.nbytes:7.3f} {arr.nbytes / enc / 1e6:12.0f} "
                  f"{arr.nbytes / dec / 1e6:12.0f}")


def make_checkpoint(path: str, scale: float, dtype) -> int:
    import torch

    g = torch.Generator().manual_seed(0)
    d, layers = 768, max(1, round(12 * scale))
    sd = {"embed.weight": torch.randn(int(30522 * scale), d, generator=g) * 0.02}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            sd[f"layers.{i}.attn.{n}.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[f"layers.{i}.mlp.down.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[f"layers.{i}.norm.weight"] = torch.ones(d)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    torch.save(sd, path)
    return sum(v.numel() * v.element_size() for v in sd.values())


# Each child also writes the seconds it spent after its imports to <last argument>.t: what a long-running
# filter process (which pays Python's start-up once per git command) spends per file.
CLEAN = r"""
import sys, time
import zipslice.torch_reader
from theta.model.clean import clean_checkpoint
from theta.storage.metadata import dumps
from theta.storage.store import LfsStore
t = time.perf_counter()
meta = clean_checkpoint(sys.argv[1], LfsStore(sys.argv[2]), None)
open(sys.argv[3], "w").write(dumps(meta))
open(sys.argv[3] + ".t", "w").write(str(time.perf_counter() - t))
"""
SMUDGE = r"""
import sys, time
import zipslice.torch_writer
from theta.storage.metadata import loads
from theta.model.smudge import smudge_checkpoint
from theta.storage.store import LfsStore
t = time.perf_counter()
smudge_checkpoint(loads(open(sys.argv[1]).read()), LfsStore(sys.argv[2]), sys.argv[3])
open(sys.argv[3] + ".t", "w").write(str(time.perf_counter() - t))
"""


def inproc(path: str) -> float:
    with open(path + ".t") as f:
        value = float(f.read())
    os.unlink(path + ".t")
    return value


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def row(name: str, step: str, th: dict, lf: dict, extra: str) -> None:
    print(f"{name:18} {step:6} {th['wall']:10.2f} {th['inproc']:7.2f} {lf['wall']:8.2f} {th['wall'] / lf['wall']:6.2f} "
          f"{th['inproc'] / lf['wall']:6.2f} "
          f"{th['cpu']:9.2f} {lf['cpu']:7.2f} {th['cpu'] / max(lf['cpu'], 1e-3):6.2f} "
          f"{th['rss_mib']:8.0f}M {lf['rss_mib']:7.0f}M {extra}")


def file_table(work: str, scale: float) -> None:
    import torch

    repo = os.path.join(work, "repo")
    subprocess.run(["git", "init", "-q", repo], check=True)
    subprocess.run(["git", "lfs", "install", "--local"], cwd=repo, check=True, capture_output=True)
    print("\n## clean / smudge vs git-lfs (each in its own subprocess)")
    print("wall = elapsed seconds of the subprocess; in-proc = theta's seconds after its imports (what a long-running\n"
          "filter process spends per file); cpu = user+sys CPU seconds of the subprocess tree")
    print(f"{'checkpoint':18} {'step':6} {'theta wall':>10} {'in-proc':>7} {'lfs wall':>8} {'ratio':>6} {'ratio*':>6} {'theta cpu':>9} "
          f"{'lfs cpu':>7} {'ratio':>6} {'theta RSS':>9} {'lfs RSS':>8} {'stored/raw':>10}")
    for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ckpt = os.path.join(work, f"model-{label}.pt")
        raw = make_checkpoint(ckpt, scale, dtype)
        objs = os.path.join(work, f"objects-{label}")
        meta = os.path.join(work, f"meta-{label}.txt")
        pointer = os.path.join(work, f"pointer-{label}.txt")
        th = measure([sys.executable, "-c", CLEAN, ckpt, objs, meta], cwd=ROOT)
        th["inproc"] = inproc(meta)
        lf = measure(["git", "lfs", "clean", "model.pt"], cwd=repo, stdin=ckpt, stdout=pointer)
        stored = du(objs)
        name = f"{label} {raw / 2**20:.0f} MiB"
        row(name, "clean", th, lf, f"{stored / raw:10.3f}")
        out = os.path.join(work, f"out-{label}.pt")
        th = measure([sys.executable, "-c", SMUDGE, meta, objs, out], cwd=ROOT)
        th["inproc"] = inproc(out)
        lf = measure(["git", "lfs", "smudge", "model.pt"], cwd=repo, stdin=pointer, stdout=os.path.join(work, "lfs-out"))
        row(name, "smudge", th, lf, "")
        a, b = torch.load(ckpt, weights_only=True), torch.load(out, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), "smudge is not bit for bit"
        for p in (ckpt, out, os.path.join(work, "lfs-out")):
            os.unlink(p)
        shutil.rmtree(objs)
    print("(ratio* = in-proc / git-lfs wall; largest group: the embedding, %.0f MiB fp32)" % (30522 * scale * 768 * 4 / 2**20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~75 MiB checkpoint and a smaller codec sample")
    ap.add_argument("--codec-only", action="store_true")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    codec_table((16 if args.quick else 64) << 20, 2 if args.quick else 3)
    if args.codec_only:
        return
    work = tempfile.mkdtemp(prefix="theta-bench-", dir="/tmp")
    try:
        file_table(work, scale)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
