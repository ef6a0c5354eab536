#!/usr/bin/env python3
"""Benchmark: what a keyframe chain costs against appended deltas, for a float32 group fine-tuned again and again.

A group of --elements float32 weights (N(0, 0.02)), then --versions fine-tunes in a row (each x(1 + 1e-3 N(0,1))).
Sizes of the blobs theta's codec writes (zstd level 0), as a share of the raw bytes:

  dense         the value alone (what a self-contained copy costs)
  delta         the zigzag delta on the previous version (what appending costs a pull)
  high          a split keyframe's first step: the base's high bits (theta.updates.keyframe)
  split         the version as one split step on that first step (what a pull fetches with keyframes)
  clone         what a fresh checkout of the version fetches: high + split (keyframes), base + every delta
                (appended)

for each --bits (low bits kept whole; theta writes split18): the measured reason for where the word is split.

    python3 scripts/bench/keyframes.py                      # 4 Mi elements, 6 fine-tunes
    python3 scripts/bench/keyframes.py --bits 16,17,18,19,20 --versions 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from theta.storage import codec  # noqa: E402
from theta.updates.delta import combine, raw_words  # noqa: E402


def size(parts: dict) -> int:
    return sum(len(c) for c in codec.iter_encode_parts(parts, codec.DEFAULT_LEVEL))


def planed(words: np.ndarray) -> codec.LazyArray:
    return codec.LazyArray(words.dtype, words.shape, lambda a, b: words[a:b], planes=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=4 << 20)
    ap.add_argument("--versions", type=int, default=6, help="fine-tunes after the base (default 6)")
    ap.add_argument("--bits", default="18", help="low bits kept whole, comma-separated (default 18: split18)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    versions = [rng.standard_normal(args.elements, dtype=np.float32) * np.float32(0.02)]
    for _ in range(args.versions):
        v = versions[-1]
        versions.append((v * (1 + np.float32(1e-3) * rng.standard_normal(v.shape, dtype=np.float32))).astype(np.float32))
    raw = versions[0].nbytes
    dense = size({"values": versions[0]})
    deltas = [size({"codes": planed(combine(raw_words(v), raw_words(p), "zigzag"))})
              for p, v in zip(versions, versions[1:])]
    print(f"{args.elements} float32 weights, {args.versions} fine-tunes of 1e-3; sizes x raw ({raw >> 20} MiB)")
    print(f"dense {dense / raw:.3f}; appended deltas: each {min(deltas) / raw:.3f}-{max(deltas) / raw:.3f}")
    for bits in (int(b) for b in args.bits.split(",")):
        high_mask = np.uint32(((1 << 32) - 1) ^ ((1 << bits) - 1))
        base_high = raw_words(versions[0]) & high_mask
        high = size({"values": base_high.view(np.float32)})
        print(f"\nsplit at {bits} low bits: first step (high part) {high / raw:.3f}")
        print(f"{'version':>8} {'split step':>11} {'delta':>7} {'clone, keyframe':>16} {'clone, appended':>16}")
        for i, v in enumerate(versions):
            w = raw_words(v)
            codes = combine(w, base_high, f"split{bits}")  # (any split point, not only the one theta writes)
            split = size({"codes": planed(codes)})
            delta = deltas[i - 1] if i else dense
            appended = dense + sum(deltas[:i])
            print(f"{'v' + str(i + 1):>8} {split / raw:>11.3f} {delta / raw:>7.3f} {(high + split) / raw:>16.3f} "
                  f"{appended / raw:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
