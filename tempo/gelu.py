"""GELU that keeps its output (which the next Linear keeps anyway) and 1 bit per element, not its input.

Stock GELU keeps its input x (b bytes per element) for backward; the following Linear keeps the output y.
This one keeps y (shared with that Linear: one storage) and a packed bit (x < x*), and recovers GELU'(x)
from them (tempo.gelu_slope): the input's b bytes become 1/8 byte, plus 8 bytes for each of the few
float32 elements so close to GELU's minimum that y cannot fix their slope (~1% in a BERT layer). Forward output is whatever the wrapped
forward computes, untouched, so it is bit-identical to the module it replaces.

Caveat: y is saved, so modifying the output in place before backward raises PyTorch's usual
"modified by an inplace operation" error (the stock GELU would not mind).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .bits import pack
from .gelu_slope import KINDS, gelu_backward_from_output, left_of_minimum, stash_near_minimum
from .threads import one_thread


class GeluFromOutputFunction(torch.autograd.Function):
    """y = forward_fn(x), a GELU of form `kind`; backward from y and the packed branch bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, forward_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = forward_fn(x)
        ctx.kind = kind
        with one_thread():
            near_index, near_slopes = stash_near_minimum(x, y, kind)
            packed = pack(left_of_minimum(x, kind))
        ctx.save_for_backward(y, packed, near_index, near_slopes)
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        y, packed, near_index, near_slopes = ctx.saved_tensors
        with one_thread():
            grad_input = gelu_backward_from_output(grad_output, y, packed, ctx.kind, near_index, near_slopes)
        return grad_input, None, None


def gelu_from_output(x: torch.Tensor, kind: str, forward_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """forward_fn(x) (a GELU of form 'erf' or 'tanh'), keeping its output and branch bits for backward."""
    if kind not in KINDS:
        raise ValueError(f"unknown GELU form {kind!r}; expected one of {KINDS}")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return forward_fn(x)
    return GeluFromOutputFunction.apply(x, kind, forward_fn)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Drop-in for F.gelu(x, approximate) keeping its output and 1 bit per element for backward."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    kind = "erf" if approximate == "none" else "tanh"
    return gelu_from_output(x, kind, partial(torch.nn.functional.gelu, approximate=approximate))


class TempoGELU(nn.GELU):
    """nn.GELU keeping its output and 1 bit per element for backward. Same forward bits."""

    _tempo_base = nn.GELU
    _tempo_technique = "gelu"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return gelu(input, self.approximate)
