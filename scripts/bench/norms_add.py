#!/usr/bin/env python3
"""What a `git add` of a changed checkpoint costs, for several checkouts of theta side by side: an interleaved A/B
of code, made to measure what recording norms (metadata ``norms``, theta/model/norms.py) costs the add.

A Llama-shaped safetensors checkpoint (one file; ``--shape``: the layer shapes of Llama-3-8B, or of TinyLlama-1.1B,
``--layers`` of them, an embedding and a head of ``--vocab`` rows) in ``--dtype`` is committed once (``base``);
then each round adds the changed version once per checkout, in turns (the order alternating from round to
round), and resets the index:

- ``--change finetune``: every element of every float group moved (x (1 + 1e-3 N(0, 1)), cast back);
- ``--change 20%``: every 5th group so moved, the others unchanged.

Each `git add` runs the filter of its checkout (PYTHONPATH), from cached bytecode. Printed per checkout: wall and CPU seconds of the process tree (median and range over the
rounds) and the peak RSS; then each checkout's CPU and wall medians against the first one's. The machine may be
shared: CPU seconds are the figure to compare.

    python3 scripts/bench/norms_add.py --code /tmp/main,.,/tmp/norms-off --dtype bfloat16 --shape llama3-8b
    python3 scripts/bench/norms_add.py --code A,B --dtype float32 --shape tinyllama --layers 5 --change 20%

A checkout may carry environment variables after ``@`` (``path@NAME=value``), as in partial_add.py.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from git import load_line, settle  # noqa: E402  (scripts/bench/git.py)
from harness import git_env, new_repo, run_measured, sh, variant_env  # noqa: E402

# (hidden, key/value width, MLP width): Llama-3-8B's (its 32 and 112 MiB bfloat16 matrices are cleaned frame
# by frame) and TinyLlama-1.1B's (its bfloat16 matrices, 1 to 22 MiB, are read whole)
SHAPES = {"llama3-8b": (4096, 1024, 14336), "tinyllama": (2048, 256, 5632)}


def groups(shape: str, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    h, kv, ff = SHAPES[shape]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (ff, h)), (p + "mlp.up_proj.weight", (ff, h)),
                (p + "mlp.down_proj.weight", (h, ff))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write_versions(data: Path, shape: str, layers: int, vocab: int, dtype: str, change: str) -> tuple[Path, Path, dict]:
    """``base`` and the changed version (safetensors, written one tensor at a time), deterministic; and what
    changed (groups, bytes)."""
    import zipslice
    from zipslice import dtypes

    np_dtype = dtypes.get(dtype).to_numpy()
    spec = groups(shape, layers, vocab)
    tag = f"{shape}-{layers}l-{vocab}v-{dtype}"
    base, changed = data / f"{tag}-base.safetensors", data / f"{tag}-{change.rstrip('%')}.safetensors"

    def value(i: int, dims: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(i)
        if len(dims) == 1:
            return (1 + 0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(np_dtype)
        return (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(np_dtype)

    def moved(i: int, dims: tuple[int, ...]) -> np.ndarray:
        v = value(i, dims).astype(np.float32)
        noise = np.random.default_rng(10_000 + i).standard_normal(dims, dtype=np.float32)
        return (v * (1 + np.float32(1e-3) * noise)).astype(np_dtype)

    touched = [i for i in range(len(spec)) if change == "finetune" or i % 5 == 0]
    data.mkdir(parents=True, exist_ok=True)
    if not base.exists():
        zipslice.save(base, ((n, value(i, d)) for i, (n, d) in enumerate(spec)))
    if not changed.exists():
        zipslice.save(changed, ((n, moved(i, d) if i in touched else value(i, d)) for i, (n, d) in enumerate(spec)))
    item = np.dtype(np_dtype).itemsize
    size = lambda d: int(np.prod(d)) * item  # noqa: E731
    return base, changed, {"groups": len(spec), "bytes": sum(size(d) for _, d in spec),
                           "changed_groups": len(touched), "changed_bytes": sum(size(spec[i][1]) for i in touched)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", required=True, help="comma-separated checkouts of this project to compare, each "
                    "optionally followed by @NAME=value environment variables")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", help="a float dtype zipslice knows (default bfloat16)")
    ap.add_argument("--change", choices=("finetune", "20%"), default="finetune")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="2", help="GIT_THETA_THREADS")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench/norms-add"))
    ap.add_argument("--keep", action="store_true", help="keep the versions written under --workdir/data")
    args = ap.parse_args()
    variants = {c: variant_env(c) for c in args.code.split(",")}
    codes = list(variants)
    base, changed, info = write_versions(args.workdir / "data", args.shape, args.layers, args.vocab, args.dtype,
                                         args.change)
    print(f"{args.shape} x {args.layers} layers, vocabulary {args.vocab}, {args.dtype}: {info['groups']} groups, "
          f"{info['bytes'] / 1e9:.2f} GB; {args.change}: {info['changed_groups']} groups changed, "
          f"{info['changed_bytes'] / 1e9:.2f} GB", flush=True)
    print(load_line(), flush=True)
    root = args.workdir / "repos"
    try:
        root.mkdir(parents=True, exist_ok=True)
        env = {**git_env(root / "home"), "GIT_THETA_THREADS": args.threads}
        first = {**env, **variants[codes[0]]}
        repo = new_repo(root, "repo", "theta", first, pattern="*.safetensors")
        shutil.copyfile(base, repo / "model.safetensors")
        sh(["git", "add", "model.safetensors"], repo, first)
        sh(["git", "commit", "-q", "-m", "base"], repo, first)
        got: dict[str, list] = {c: [] for c in codes}
        for r in range(args.rounds):
            for c in codes if r % 2 == 0 else codes[::-1]:
                run_env = {**env, **variants[c]}
                shutil.copyfile(changed, repo / "model.safetensors")
                settle(repo, run_env)
                m = run_measured(["git", "add", "model.safetensors"], repo, run_env)
                got[c].append(m)
                sh(["git", "reset", "-q"], repo, run_env)
                print(f"  round {r + 1} {c}: {m.seconds:.2f} s wall, {m.cpu:.2f} s CPU", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.workdir / "data", ignore_errors=True)
    print(f"\ngit add of the {args.change} ({args.rounds} interleaved rounds per checkout):")
    ref = codes[0]
    med = {c: (statistics.median(m.seconds for m in ms), statistics.median(m.cpu for m in ms)) for c, ms in got.items()}
    for c, ms in got.items():
        wall, cpu = [m.seconds for m in ms], [m.cpu for m in ms]
        print(f"  {c}: CPU median {med[c][1]:.2f} s [{min(cpu):.2f}..{max(cpu):.2f}], wall median {med[c][0]:.2f} s "
              f"[{min(wall):.2f}..{max(wall):.2f}], peak RSS {max(m.peak_tree_rss for m in ms) / 2**20:.0f} MiB"
              + ("" if c == ref else f"; vs {ref}: CPU {100 * (med[c][1] / med[ref][1] - 1):+.1f}%, "
                                     f"wall {100 * (med[c][0] / med[ref][0] - 1):+.1f}%"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
