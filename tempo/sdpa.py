"""Does tempo's attention keep less for backward than torch's scaled_dot_product_attention? Measured.

SDPA picks its kernel by device, dtype, dropout, mask and causality, and what that kernel keeps for backward
is torch's business: on CPU with dropout its math kernel keeps what eager attention keeps (the softmax
output P, the dropout mask, dropout(P): several [B, A, S, S] tensors); without dropout, or on CUDA, fused
kernels keep Q, K, V, the output and a log-sum-exp per row (no S × S tensor at all). So tempo does not
guess: `compare` runs both on a probe of the same device, dtype, dropout, mask kind and causality, each
followed by an output projection (SDPA's keeps the context, tempo's rebuilds it: tempo.context), under
torch's saved-tensor hooks, and counts the bytes of every storage kept, once, the projection's weight
apart. The probe has S much larger than D, so the S × S tensors decide, as they do for the sequence lengths
where attention memory matters. It is run once per key and remembered; it leaves the RNG as it found it
and sees no saved-tensor hooks of the caller's (tempo.measure counts none of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from .attend import attend
from .context import project_context

PROBE_BATCH, PROBE_HEADS, PROBE_LENGTH, PROBE_HEAD_DIM = 1, 2, 128, 4
MASK_KINDS = ("none", "bool", "float")


@dataclass(frozen=True)
class Comparison:
    """Bytes kept for backward by SDPA and by tempo's path (attention and output projection), on the probe."""

    device: str
    dtype: torch.dtype
    p: float
    mask: str  # "none", "bool" or "float" (additive)
    causal: bool
    sdpa_bytes: int
    tempo_bytes: int

    @property
    def tempo_keeps_less(self) -> bool:
        return self.tempo_bytes < self.sdpa_bytes

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        mask = "causal" if self.causal else {"none": "no mask", "bool": "boolean mask", "float": "additive mask"}[self.mask]
        return (f"on {self.device} {dtype}, dropout {self.p:g}, {mask}, SDPA keeps {_kib(self.sdpa_bytes)} for "
                f"backward and tempo {_kib(self.tempo_bytes)} (probe: {PROBE_HEADS} heads of {PROBE_LENGTH} x "
                f"{PROBE_LENGTH} scores, head dim {PROBE_HEAD_DIM})")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def mask_kind(mask: torch.Tensor | None) -> str:
    if mask is None:
        return "none"
    return "bool" if mask.dtype == torch.bool else "float"


@torch.compiler.disable
def compare(device: torch.device | str, dtype: torch.dtype, p: float, mask: str = "none",
            causal: bool = False) -> Comparison:
    """What SDPA and tempo's path keep for backward on `device` in `dtype`, with dropout p and a mask of
    kind `mask` (or is_causal, without one); measured once per distinct argument set."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    if mask not in MASK_KINDS:
        raise ValueError(f"mask kind {mask!r}: expected one of {MASK_KINDS}")
    return _compare(str(device), dtype, float(p), mask, bool(causal and mask == "none"))


@lru_cache(maxsize=None)
def _compare(device: str, dtype: torch.dtype, p: float, mask: str, causal: bool) -> Comparison:
    where = torch.device(device)
    rng_devices = [] if where.type == "cpu" else [where.index]
    with torch.random.fork_rng(devices=rng_devices, device_type=where.type), torch.enable_grad():
        sdpa = _kept_bytes(lambda q, k, v, m, w: _sdpa_path(q, k, v, m, w, p, causal), where, dtype, mask, causal)
        ours = _kept_bytes(lambda q, k, v, m, w: _tempo_path(q, k, v, m, w, p, causal), where, dtype, mask, causal)
    return Comparison(device, dtype, p, mask, causal, sdpa, ours)


def _sdpa_path(query, key, value, mask, weight, p, causal):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=p, is_causal=causal)
    context = out.transpose(1, 2).contiguous()
    return F.linear(context.view(*context.shape[:2], -1), weight)


def _tempo_path(query, key, value, mask, weight, p, causal):
    additive = _additive(mask, causal, query)
    context, _, _ = attend(query, key, value, additive, query.size(-1) ** -0.5, p)
    flat = context.view(*context.shape[:2], -1)
    out = project_context(flat, weight, None)
    return F.linear(flat, weight) if out is None else out


def _additive(mask: torch.Tensor | None, causal: bool, query: torch.Tensor) -> torch.Tensor | None:
    """The probe's mask as eager attention adds it."""
    if causal:
        length = query.size(-2)
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device), torch.finfo(query.dtype).min)


def _probe_inputs(device: torch.device, dtype: torch.dtype, mask: str):
    shape = (PROBE_BATCH, PROBE_HEADS, PROBE_LENGTH, PROBE_HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    weight = torch.randn(PROBE_HEADS * PROBE_HEAD_DIM, PROBE_HEADS * PROBE_HEAD_DIM, device=device).to(dtype)
    keep = None
    if mask != "none":  # padding: the last eighth of the keys
        keep = torch.ones(PROBE_BATCH, 1, PROBE_LENGTH, PROBE_LENGTH, dtype=torch.bool, device=device)
        keep[..., -PROBE_LENGTH // 8:] = False
        if mask == "float":
            keep = _additive(keep, False, q)
    return q, k, v, keep, weight.requires_grad_()


def _kept_bytes(path, device: torch.device, dtype: torch.dtype, mask: str, causal: bool) -> int:
    q, k, v, m, weight = _probe_inputs(device, dtype, mask)
    ignored = {weight.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.layout == torch.strided and storage.nbytes() and storage.data_ptr() not in ignored:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = path(q, k, v, m, weight)
    del out
    return sum(kept.values())
