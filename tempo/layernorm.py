"""LayerNorm that keeps its output (which the next layer keeps anyway) instead of its input.

Stock LayerNorm keeps its input x, mean and rstd; backward needs x_hat = (x - mean) * rstd. This one keeps
the output y, rstd and nothing else: x_hat = (y - beta) / gamma. Since y is what the following Linear keeps
for its own backward, the two share one storage and the input's b * numel bytes are saved.

Recovering x_hat from y divides y's rounding error (~ulp(|gamma x_hat| + |beta|)) by |gamma|, which is
harmless when |beta| <= ratio * |gamma| (error <= ~(2 + ratio) ulp of x_hat) and ruinous when gamma is ~0
(the released Tempo turned dx into NaN/Inf with 3 of 768 gamma at 0). So for the columns where
|gamma| < tiny or |beta| > ratio * |gamma|, x_hat itself is kept (a [rows, k] tensor, k usually 0).
Forward is torch.native_layer_norm, i.e. bit-identical to F.layer_norm.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .threads import one_thread

DEFAULT_RATIO = 1.0  # keep x_hat where |beta| > ratio * |gamma|


def columns_to_keep(weight: torch.Tensor | None, bias: torch.Tensor | None, ratio: float = DEFAULT_RATIO) -> torch.Tensor:
    """Indices (flattened over the normalized dims) of the columns whose x_hat must be kept, int64."""
    if weight is None:
        return torch.zeros(0, dtype=torch.int64)
    gamma = weight.detach().reshape(-1).abs()
    finfo = torch.finfo(weight.dtype)
    keep = gamma < finfo.tiny / finfo.eps  # below this gamma * x_hat runs into subnormals
    if bias is not None:
        keep |= bias.detach().reshape(-1).abs() > ratio * gamma
    return keep.nonzero().squeeze(1)


class LayerNormFromOutputFunction(torch.autograd.Function):
    """y = layer_norm(x); backward from y, rstd and the kept x_hat columns."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, ratio):
        normalized_shape = tuple(normalized_shape)
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        columns = 1
        for size in normalized_shape:
            columns *= size
        keep = columns_to_keep(weight, bias, ratio).to(x.device)
        if keep.numel():
            rows = x.reshape(-1, columns).index_select(1, keep)
            kept_x_hat = (rows.to(rstd.dtype) - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)
        else:
            kept_x_hat = x.new_empty((0,), dtype=rstd.dtype)
        ctx.columns = columns
        ctx.save_for_backward(y, rstd, weight, bias, keep, kept_x_hat)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        with one_thread():
            return LayerNormFromOutputFunction._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output):
        y, rstd, weight, bias, keep, kept_x_hat = ctx.saved_tensors
        columns = ctx.columns
        compute = torch.float64 if y.dtype == torch.float64 else torch.float32
        y2 = y.reshape(-1, columns).to(compute)
        g2 = grad_output.reshape(-1, columns).to(compute)
        rstd2 = rstd.reshape(-1, 1).to(compute)
        if weight is not None:
            gamma = weight.reshape(-1).to(compute)
            beta = bias.reshape(-1).to(compute) if bias is not None else None
            safe_gamma = gamma.clone()
            if keep.numel():
                safe_gamma.index_fill_(0, keep, 1.0)
            x_hat = (y2 - beta if beta is not None else y2.clone()).div_(safe_gamma)
        else:
            x_hat = y2.clone()
        if keep.numel():
            x_hat.index_copy_(1, keep, kept_x_hat.to(compute))
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[2]:
            grad_weight = (g2 * x_hat).sum(0).view(weight.shape).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_bias = g2.sum(0).view(bias.shape).to(bias.dtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            g_hat = g2 * gamma if weight is not None else g2
            mean_g = g_hat.mean(1, keepdim=True)
            mean_gx = (g_hat * x_hat).mean(1, keepdim=True)
            grad_input = (g_hat - mean_g - x_hat * mean_gx).mul_(rstd2).view(y.shape).to(y.dtype)
        return grad_input, None, grad_weight, grad_bias, None, None


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    ratio: float = DEFAULT_RATIO,
) -> torch.Tensor:
    """Drop-in for F.layer_norm keeping its output instead of its input for backward."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    if not needs_grad:
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)
    return LayerNormFromOutputFunction.apply(x, tuple(normalized_shape), weight, bias, eps, ratio)


class TempoLayerNorm(nn.LayerNorm):
    """nn.LayerNorm keeping its output for backward. Same parameters, eps, state_dict and forward bits."""

    _tempo_base = nn.LayerNorm
    _tempo_technique = "layernorm"

    tempo_ratio: float = DEFAULT_RATIO

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, self.tempo_ratio)
