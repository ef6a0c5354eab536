"""When tempo takes over Hugging Face's "sdpa" attention, and the eager mask it then adds.

A model built from its config runs `attn_implementation="sdpa"` (torch's scaled_dot_product_attention).
On CPU, in training with dropout, SDPA's math kernel keeps what eager attention keeps (P, the dropout mask,
dropout(P)); tempo's path keeps less, and takes over. Elsewhere a fused kernel keeps less than tempo would
(no dropout, eval, CUDA's flash and memory-efficient kernels), and SDPA runs. Which one keeps less is
measured (tempo.sdpa.compare), not assumed.

Taken over, a call runs eager attention's ops (tempo.attend), so its forward, RNG use and gradients are
those of the same model with `attn_implementation="eager"` (patched or stock) bit for bit; against stock
SDPA they differ by SDPA's own rounding (its math kernel scales Q and K by √scaling each). The arguments
HF hands to SDPA become eager's: a boolean mask (True: attend) becomes eager's additive one, 0 or the
dtype's minimum in the dtype of the module's parameters (eager masks take the embeddings' dtype); no mask
on a causal module becomes eager's causal mask.

Imported by tempo.hf only (transformers is imported by then).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .sdpa import Comparison, compare, mask_kind

SDPA = "sdpa"


@dataclass(frozen=True)
class Plan:
    """A call tempo takes over: the additive mask eager attention would have added (None: none)."""

    mask: torch.Tensor | None


def is_causal(module: nn.Module, kwargs: dict) -> bool:
    """Whether SDPA would run this call causally when no mask is given (sdpa_attention_forward's rule)."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _parameter_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    for parameter in module.parameters():
        return parameter.dtype
    return default


def _parameter_device(module: nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    return torch.device("cpu")


def own_sdpa_function() -> bool:
    """Whether "sdpa" still names transformers' own function (a user may register another under it)."""
    return ALL_ATTENTION_FUNCTIONS.get(SDPA) is sdpa_attention_forward


def plan(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> Plan | None:
    """How to run this sdpa call through tempo's path, or None to leave it to SDPA."""
    if not (module.training and dropout > 0.0 and torch.is_grad_enabled()):
        return None  # no dropout (eval included): SDPA's fused kernel keeps less; no grad: nothing is kept
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        return None  # grouped key/value heads: SDPA broadcasts them, eager attention here does not
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or not own_sdpa_function():
        return None
    mask = attention_mask
    causal = mask is None and query.size(-2) > 1 and is_causal(module, kwargs)
    if causal and query.size(-2) != key.size(-2):
        return None  # SDPA's top-left causal alignment after HF crops the keys: not eager's mask
    comparison = compare(query.device, query.dtype, dropout, mask_kind(mask), causal)
    if not comparison.tempo_keeps_less:
        return None
    dtype = _parameter_dtype(module, query.dtype)
    if causal:
        length = query.size(-2)
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)
    return Plan(mask)


def patch_time_comparison(module: nn.Module, p: float) -> Comparison:
    """What SDPA and tempo keep for this module where it is now, in training with its own dropout p and
    no padding mask (causal if the module is)."""
    device = _parameter_device(module)
    dtype = _parameter_dtype(module, torch.get_default_dtype())
    return compare(device, dtype, p, "none", is_causal(module, {}))


def verdict(module: nn.Module, dropout_attribute: str) -> tuple[bool, str]:
    """(take over?, why): at patch time, for a module whose model runs "sdpa"."""
    if not own_sdpa_function():
        return False, "'sdpa' is registered to a function other than transformers' own: left to it"
    dropout = getattr(module, dropout_attribute, None)
    p = dropout.p if isinstance(dropout, nn.Dropout) else 0.0
    comparison = patch_time_comparison(module, p)
    if comparison.tempo_keeps_less:
        note = f"sdpa: tempo's path in training with dropout, measured {comparison}; SDPA otherwise"
        if not module.training:
            note += " (in eval mode now: SDPA until model.train())"
        return True, note
    why = "without dropout SDPA runs a fused kernel" if p == 0.0 else "SDPA's kernel keeps less"
    return False, f"attention implementation 'sdpa', {why}: measured {comparison}; left to SDPA"
