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

Then the transfer benchmark's push (scripts/bench/transfer.py: v1, v2 fine-tuning the groups that hold
--changed-share of the bytes, v3 a full fine-tune of v2) as a share of git-lfs's three raw versions, with the
clone of v3 beside it, for each way of storing the versions: appended deltas, keyframes split at each --bits,
and an ideal lossless coder -- the entropy of v1 and of a fine-tune given the version before, estimated from
the same weights (plug-in entropies: v1's sign, exponent and top 8 mantissa bits, its next 7 bits, its low byte; the
difference of a fine-tune's words from the previous ones, its top bits given the previous word's exponent and
top 4 mantissa bits, plus its low 8 bits). No lossless coder sends much fewer bytes than that, and at a
link-bound rate no push takes a smaller share of the time than of the bytes.

    python3 scripts/bench/keyframes.py                      # 4 Mi elements, 6 fine-tunes
    python3 scripts/bench/keyframes.py --bits 16,17,18,19,20 --versions 3
    python3 scripts/bench/keyframes.py --bits 12,14,16,18,20 --versions 2   # the push bound
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from git import group_shapes, tuned_in_v2  # noqa: E402  (scripts/bench/git.py: the transfer history)
from transfer import DEFAULT_SCALE  # noqa: E402

from theta.storage import codec  # noqa: E402
from theta.updates.delta import combine, raw_words  # noqa: E402


def size(parts: dict) -> int:
    return sum(len(c) for c in codec.iter_encode_parts(parts, codec.DEFAULT_LEVEL))


def planed(words: np.ndarray) -> codec.LazyArray:
    return codec.LazyArray(words.dtype, words.shape, lambda a, b: words[a:b], planes=True)


def entropy(*symbols: np.ndarray) -> float:
    """Plug-in entropy in bits of the joint distribution of ``symbols`` (integer arrays of one length)."""
    joint = np.stack([np.asarray(s, np.int64) for s in symbols], axis=1)
    _, counts = np.unique(joint, axis=0, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def byte_entropy(values: np.ndarray) -> float:
    return entropy(np.asarray(values) & 0xFF)


def value_bits(words: np.ndarray) -> tuple[float, float]:
    """(estimated entropy per float32 word in bits, byte entropy of its low byte): the joint entropy of its top
    17 bits (sign, exponent, top 8 mantissa bits), plus those of its next 7 bits and of its low byte."""
    low = byte_entropy(words)
    return entropy(words >> 15) + entropy((words >> 8) & 0x7F) + low, low


def change_bits(new: np.ndarray, old: np.ndarray) -> tuple[float, float]:
    """(estimated entropy of ``new`` given ``old`` per float32 word in bits, byte entropy of the difference's low
    8 bits): the words' difference, its top bits given the old word's exponent and top 4 mantissa bits."""
    d = new.astype(np.int64) - old.astype(np.int64)
    context = old >> 19
    return entropy(d >> 8, context) - entropy(context) + 8, byte_entropy(d)


def changed_share(scale: float) -> float:
    """The share of the transfer history's bytes whose groups v2 fine-tunes."""
    shapes = group_shapes(scale)
    numel = {name: int(np.prod(shape)) for name, shape in shapes}
    return sum(numel[n] for n in tuned_in_v2(shapes)) / sum(numel.values())


def push_table(rows: list[tuple[str, float, float]], f: float) -> None:
    """Each way of storing the history: (name, push of v1..v3, clone of v3), in raw versions."""
    print(f"\nthe transfer history's push of v1..v3 (v2 fine-tunes {f:.3f} of the bytes), x git-lfs's 3 raw versions")
    print(f"{'stored as':>22} {'push':>7} {'clone of v3':>12}")
    for name, push, clone in rows:
        print(f"{name:>22} {push / 3:>7.3f} {clone:>12.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=4 << 20)
    ap.add_argument("--versions", type=int, default=6, help="fine-tunes after the base (default 6)")
    ap.add_argument("--bits", default="18", help="low bits kept whole, comma-separated (default 18: split18)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--changed-share", type=float, default=None,
                    help="share of the bytes v2 fine-tunes (default: the transfer history's)")
    args = ap.parse_args()
    f = changed_share(DEFAULT_SCALE) if args.changed_share is None else args.changed_share
    rng = np.random.default_rng(args.seed)
    versions = [rng.standard_normal(args.elements, dtype=np.float32) * np.float32(0.02)]
    for _ in range(args.versions):
        v = versions[-1]
        versions.append((v * (1 + np.float32(1e-3) * rng.standard_normal(v.shape, dtype=np.float32))).astype(np.float32))
    raw = versions[0].nbytes
    dense = size({"values": versions[0]}) / raw
    deltas = [size({"codes": planed(combine(raw_words(v), raw_words(p), "zigzag"))}) / raw
              for p, v in zip(versions, versions[1:])]
    print(f"{args.elements} float32 weights, {args.versions} fine-tunes of 1e-3; sizes x raw ({raw >> 20} MiB)")
    print(f"dense {dense:.3f}; appended deltas: each {min(deltas):.3f}-{max(deltas):.3f}")
    rows = []
    if args.versions >= 2:  # v3 of the transfer history: a fine-tune of v1 (unchanged in v2) or of v2
        rows.append(("appended deltas", dense + deltas[0] + f * deltas[1], dense + deltas[0] + f * deltas[1]))
    for bits in (int(b) for b in args.bits.split(",")):
        high_mask = np.uint32(((1 << 32) - 1) ^ ((1 << bits) - 1))
        base_high = raw_words(versions[0]) & high_mask
        high = size({"values": base_high.view(np.float32)}) / raw
        print(f"\nsplit at {bits} low bits: first step (high part) {high:.3f}")
        print(f"{'version':>8} {'split step':>11} {'delta':>7} {'clone, keyframe':>16} {'clone, appended':>16}")
        splits = []
        for i, v in enumerate(versions):
            w = raw_words(v)
            codes = combine(w, base_high, f"split{bits}")  # (any split point, not only the one theta writes)
            splits.append(size({"codes": planed(codes)}) / raw)
            delta = deltas[i - 1] if i else dense
            appended = dense + sum(deltas[:i])
            print(f"{'v' + str(i + 1):>8} {splits[-1]:>11.3f} {delta:>7.3f} {high + splits[-1]:>16.3f} "
                  f"{appended:>16.3f}")
        if args.versions >= 2:
            v3 = f * splits[2] + (1 - f) * splits[1]
            rows.append((f"keyframes, split{bits}", high + splits[0] + f * splits[1] + v3, high + v3))
    if args.versions < 2:
        print("\n(the push table needs --versions 2 or more)")
        return 0
    words = [raw_words(v) for v in versions[:3]]
    h1, low1 = value_bits(words[0])
    h3, _ = value_bits(words[2])
    d01, low01 = change_bits(words[1], words[0])
    d12, _ = change_bits(words[2], words[1])
    print(f"\nestimated entropy, bits per weight: v1 {h1:.2f} (its low byte {low1:.4f} bits of 8), v3 {h3:.2f}; "
          f"a fine-tune given the version before {d01:.2f} / {d12:.2f} (the difference's low byte {low01:.4f})")
    rows.append(("entropy (ideal coder)", (h1 + f * d01 + f * d12 + (1 - f) * d01) / 32, h3 / 32))
    push_table(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
