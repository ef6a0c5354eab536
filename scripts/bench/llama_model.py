"""A checkpoint with the tensor names and shapes of Llama-3-8B's first 4 layers, and versions of it: no download.

The one home of this model for the benchmarks and the tests (which import it as scripts.bench.llama_model): numpy
and zipslice's safetensors header only, no torch.

bfloat16, written as a Hugging Face sharded safetensors checkpoint, as ``save_pretrained`` lays it out:
``model-00001-of-00002.safetensors``, ``model-00002-of-00002.safetensors`` and ``model.safetensors.index.json``
(3.85 GB; ``model.embed_tokens.weight`` and ``lm_head.weight`` are 128256 x 4096: 1.0 GB each). Shard 1 holds
the embedding and layers 0-1, shard 2 layers 2-3, the final norm and the head (1.92 GB each). Each shard is
the safetensors library's layout (tensors sorted by name, ``__metadata__ {"format": "pt"}``), so a tool that
rewrites it the library's way reproduces it bit for bit.

Content is deterministic random (normal * 0.02 for matrices, 1 + 0.05 N for the norms): every chunk of every
tensor comes from its own seeded generator. The versions (each derived from its parent's files, chunk by chunk):

    base        the pretrained checkpoint
    finetune    a full fine-tune of base: every element x(1 + 8e-3 N), so most bfloat16 values move
    partial     a partial change of finetune: every tensor of layer 3 and the final norm fine-tuned, and the
                last 256 rows (Llama-3's reserved special tokens) of the embedding and the head
    finetune2   another full fine-tune of base (the other side of a merge)
    side        finetune with layer 0's MLP fine-tuned (disjoint from partial: a rebase or cherry-pick merges
                without numeric work)
    rebased     partial with side's change: what rebasing side onto partial (or cherry-picking it) gives

Memory: one chunk (16 Mi elements) at a time, whatever the tensor's size. ``Dims(..., tied=True)``: the head
shares the embedding (no ``lm_head.weight``, as Llama-3.2-1B stores it).

    from llama_model import LLAMA3_8B_4L, write_version      # scripts/bench on sys.path
    d = write_version(Path("/tmp/data"), "base")              # -> /tmp/data/llama-base/ (made once, then reused)

    python3 scripts/bench/llama_model.py --out /tmp/data --versions base,finetune   # the same from a shell
    python3 scripts/bench/llama_model.py --out /tmp/data --scale 0.125              # a proportionally small one
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's zipslice, run as a script or imported by one
from zipslice.info import TensorSource  # noqa: E402
from zipslice.safetensors_format import build_header, library_order  # noqa: E402

CHUNK = 16 << 20          # elements generated at a time (32 MiB of bfloat16)
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
SPECIAL_ROWS = 256        # Llama-3's reserved special tokens: the last 256 rows of the vocabulary


@dataclass(frozen=True)
class Dims:
    hidden: int = 4096
    intermediate: int = 14336
    kv: int = 1024          # 8 key/value heads of 128
    vocab: int = 128256
    layers: int = 4
    tied: bool = False      # the head shares the embedding: no lm_head.weight

    def scaled(self, f: float) -> "Dims":
        """A proportionally smaller model (every dimension times ``f``, multiples of 8; at least 2 layers)."""
        def r(n):
            return max(8, int(n * f) // 8 * 8)
        return Dims(r(self.hidden), r(self.intermediate), r(self.kv), r(self.vocab), max(2, self.layers), self.tied)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) in the model's state-dict order."""
        h, out = self.hidden, [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (self.kv, h)),
                    (p + "self_attn.v_proj.weight", (self.kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                    (p + "mlp.up_proj.weight", (self.intermediate, h)),
                    (p + "mlp.down_proj.weight", (h, self.intermediate)),
                    (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out.append(("model.norm.weight", (h,)))
        return out if self.tied else out + [("lm_head.weight", (self.vocab, self.hidden))]

    def shard_of(self, name: str) -> int:
        """0 for the embedding and the first half of the layers, 1 for the rest."""
        if name.startswith("model.layers."):
            return int(int(name.split(".")[2]) >= (self.layers + 1) // 2)
        return 0 if name == "model.embed_tokens.weight" else 1

    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * 2 for _, s in self.tensors())


LLAMA3_8B_4L = Dims()

def _tuned(d: Dims, name: str, version: str) -> slice | None | bool:
    """Rows of ``name`` that ``version`` changes against its parent: a slice, None (the whole tensor), or False."""
    if version in ("finetune", "finetune2"):
        return None
    if version == "partial":
        last = f"model.layers.{d.layers - 1}."
        if name.startswith(last) or name == "model.norm.weight":
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return slice(d.vocab - min(SPECIAL_ROWS, d.vocab // 8), d.vocab)
        return False
    if version in ("side", "rebased"):
        return None if name.startswith("model.layers.0.mlp.") else False
    raise ValueError(version)


# version -> (its parent, the seed of its changes)
VERSIONS = {"base": (None, 0), "finetune": ("base", 1), "partial": ("finetune", 2), "finetune2": ("base", 3),
            "side": ("finetune", 4), "rebased": ("partial", 4)}


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (as torch's .to(torch.bfloat16))."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _fresh(name: str, ti: int, ci: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([0, ti, ci])
    x = rng.standard_normal(n, dtype=np.float32)
    if name.endswith("norm.weight"):
        x *= np.float32(0.05)
        x += np.float32(1.0)
    else:
        x *= np.float32(0.02)
    return _bf16(x)


def _tune(bits: np.ndarray, seed: int, ti: int, ci: int) -> np.ndarray:
    x = _f32(bits)
    x *= np.float32(1) + np.random.default_rng([seed, ti, ci]).standard_normal(x.size, dtype=np.float32) * \
        np.float32(8e-3)
    return _bf16(x)


def version_dir(root: Path, version: str, d: Dims = LLAMA3_8B_4L) -> Path:
    tag = "" if d == LLAMA3_8B_4L else f"-{d.hidden}h{d.intermediate}i{d.kv}k{d.vocab}v{d.layers}l" + "t" * d.tied
    return Path(root) / f"llama-{version}{tag}"


def write_version(root: Path, version: str, d: Dims = LLAMA3_8B_4L, progress: bool = False) -> Path:
    """The directory holding ``version`` (its two shards and the index), written once (its parents first)."""
    out = version_dir(root, version, d)
    if (out / INDEX).exists():
        return out
    parent, seed = VERSIONS[version]
    parent_dir = write_version(root, parent, d, progress) if parent else None
    if progress:
        print(f"writing {out} ({d.nbytes() / 1e9:.2f} GB) ...", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = d.tensors()
    index = {n: i for i, (n, _) in enumerate(tensors)}
    weight_map = {}
    for k, shard in enumerate(SHARDS):
        names = [(n, s) for n, s in tensors if d.shard_of(n) == k]
        srcs = library_order([TensorSource(n, "bfloat16", s, read=None) for n, s in names])
        parent_maps = _parent_arrays(parent_dir / shard) if parent_dir else {}
        with open(tmp / shard, "wb") as f:
            f.write(build_header(srcs, {"format": "pt"}))
            for s in srcs:
                _write_tensor(f, s, index[s.name], version, seed, d, parent_maps.get(s.name))
        weight_map.update({s.name: shard for s in srcs})
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": d.nbytes()}, "weight_map": weight_map},
                                        indent=2, sort_keys=True) + "\n")
    tmp.rename(out)
    return out


def _parent_arrays(path: Path) -> dict[str, np.ndarray]:
    """name -> the parent's bfloat16 bits of that tensor (a flat uint16 memory map of its file)."""
    import zipslice

    with zipslice.load(path) as lsd:
        spans = {n: (lsd.info(n).offset, lsd.info(n).numel) for n in lsd}
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    return {n: whole[off:off + 2 * numel].view(np.uint16) for n, (off, numel) in spans.items()}


def _write_tensor(f, s: TensorSource, ti: int, version: str, seed: int, d: Dims, parent: np.ndarray | None):
    numel = int(np.prod(s.shape))
    row = int(np.prod(s.shape[1:])) if len(s.shape) > 1 else 1
    rows = None if parent is None else _tuned(d, s.name, version)
    changed = (0, numel) if rows is None else (0, 0) if rows is False else (rows.start * row, rows.stop * row)
    for ci, start in enumerate(range(0, numel, CHUNK)):
        stop = min(numel, start + CHUNK)
        if parent is None:
            bits = _fresh(s.name, ti, ci, stop - start)
        else:
            bits = np.array(parent[start:stop])
            a, b = max(start, changed[0]), min(stop, changed[1])
            if a < b:
                bits[a - start:b - start] = _tune(bits[a - start:b - start], seed, ti, ci)
        f.write(memoryview(bits).cast("B"))


def sha256_files(d: Path, names=SHARDS) -> dict[str, str]:
    """name -> sha256 of each shard (read 16 MiB at a time)."""
    out = {}
    for n in names:
        h = hashlib.sha256()
        with open(d / n, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        out[n] = h.hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/theta-bench/data"))
    ap.add_argument("--versions", default=",".join(VERSIONS), help=f"which (default all: {', '.join(VERSIONS)})")
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension times this (default 1: the real shapes)")
    args = ap.parse_args(argv)
    d = LLAMA3_8B_4L if args.scale == 1 else LLAMA3_8B_4L.scaled(args.scale)
    for v in args.versions.split(","):
        print(write_version(args.out, v, d, progress=True))
    return 0
