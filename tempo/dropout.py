"""Dropout that keeps a 1-bit mask for backward, drawn from the same RNG stream as PyTorch's own.

Stock dropout keeps its mask for backward as a float tensor on CPU (b bytes per element) and as a bool
tensor on CUDA (1 byte); this one keeps 1 bit. Forward output, RNG consumption and gradient are
bit-identical to `torch.nn.functional.dropout` on the same device: `dropout_with_mask` runs the very ops
PyTorch's dropout runs there (fused `native_dropout` on CUDA/XPU/lazy/privateuse1, `bernoulli_` then
divide then multiply elsewhere) and reads the mask off them.
"""
from __future__ import annotations

import torch
from torch import nn

from .bits import pack, unpack_float

_FUSED_DEVICE_TYPES = {"cuda", "xpu", "lazy", torch._C._get_privateuse1_backend_name()}


def dropout_with_mask(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.dropout(x, p, training=True), keep mask as bool), consuming the RNG exactly as F.dropout does."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 1.0:
        return x * torch.zeros((), dtype=x.dtype, device=x.device), torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if x.device.type in _FUSED_DEVICE_TYPES and p > 0.0 and x.numel() > 0:
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1.0 - p)  # the ops of ATen's _dropout_impl, in its order
    noise.div_(1.0 - p)
    return x * noise, noise != 0


def keep_scale(p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The value dropout multiplies kept elements by, exactly as stock computes it (1 / (1 - p) in dtype)."""
    return torch.ones((), dtype=dtype, device=device).div_(1.0 - p)


def noise_from_bits(packed: torch.Tensor, shape: torch.Size, p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The multiplier stock dropout used (0 or 1 / (1 - p)), rebuilt from packed keep bits."""
    numel = 1
    for size in shape:
        numel *= int(size)
    keep = unpack_float(packed, numel, dtype).view(shape)
    if p == 1.0:
        return keep  # all zeros
    return keep.mul_(keep_scale(p, dtype, device))


class PackedDropoutFunction(torch.autograd.Function):
    """y = dropout(x, p) keeping only the packed keep bits for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        out, keep = dropout_with_mask(x, p)
        ctx.p = p
        ctx.shape = x.shape
        ctx.save_for_backward(pack(keep))
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (packed,) = ctx.saved_tensors
        noise = noise_from_bits(packed, ctx.shape, ctx.p, grad_output.dtype, grad_output.device)
        return grad_output * noise, None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """Drop-in for F.dropout(x, p, training) (not in-place) that keeps 1 bit per element for backward."""
    if not training or p == 0.0 or not (torch.is_grad_enabled() and x.requires_grad):
        return torch.nn.functional.dropout(x, p, training)
    return PackedDropoutFunction.apply(x, p)


class TempoDropout(nn.Dropout):
    """nn.Dropout keeping a 1-bit mask for backward. Same parameters, RNG stream, outputs and gradients."""

    _tempo_base = nn.Dropout
    _tempo_technique = "dropout"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(input)
        return dropout(input, self.p, self.training)
