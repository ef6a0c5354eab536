"""The attention output projection, keeping nothing of its input: the context is rebuilt in backward.

The Linear after attention (BERT's `attention.output.dense`, GPT-2's `c_proj`) keeps its input, the
attention context dropout(P) @ V (b * B*S*H bytes), for its weight gradient. tempo's fused attention keeps
P, the packed dropout mask and V anyway (tempo.attention.KeptAttention), and those fix the context: one
batched matmul (B*A*S*S*D multiply-adds, ~1 % of a BERT layer's) rebuilds it bit for bit. So the context
the fused attention returns is marked with what it keeps (`mark_context`), and the projection, when its
input is such a context untouched since, keeps references to those same tensors instead (no new bytes).
Any other input, eval mode or no grad: the stock forward, which keeps its input as usual. Forward output
is the stock op's (F.linear, or addmm for a transposed weight), bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import KeptAttention

_MARK = "_tempo_context"


@dataclass(frozen=True)
class _Context:
    kept: KeptAttention
    version: int  # the context tensor's version when marked: an in-place change since voids the recipe


# Under torch.compile both run eagerly (graph breaks): dynamo cannot trace Python attributes on tensors,
# `_base` or `_version`. If a compiled graph hands the projection a context that is not a view of the
# marked tensor, the projection falls back to keeping its input (correct, no saving).
@torch.compiler.disable
def mark_context(context: torch.Tensor, kept: KeptAttention | None) -> torch.Tensor:
    """Mark `context` == kept.output().transpose(1, 2).contiguous() (the layout attention hands to its
    output projection) as rebuildable from `kept`; returns it."""
    if kept is not None:
        setattr(context, _MARK, _Context(kept, context._version))
    return context


def kept_for(input: torch.Tensor) -> KeptAttention | None:
    """What rebuilds `input`, if it is (a contiguous reshape of) a marked context not modified since."""
    base = input if input._base is None else input._base
    mark = getattr(base, _MARK, None)
    if mark is None or base._version != mark.version or not input.is_contiguous():
        return None
    if input.data_ptr() != base.data_ptr() or input.numel() != base.numel():
        return None
    return mark.kept


def rebuild_context(kept: KeptAttention, shape: torch.Size) -> torch.Tensor:
    """The marked context, recomputed, viewed as `shape`."""
    return kept.output().transpose(1, 2).contiguous().view(shape)


class ContextProjectionFunction(torch.autograd.Function):
    """y = input @ W^T + b (weight_in_out: input @ W + b, HF's Conv1D), keeping the attention's kept tensors
    instead of input."""

    @staticmethod
    def forward(ctx, input, weight, bias, kept: KeptAttention, weight_in_out: bool):
        if weight_in_out:
            out = torch.addmm(bias, input.view(-1, input.size(-1)), weight).view(*input.shape[:-1], weight.size(1))
        else:
            out = torch.nn.functional.linear(input, weight, bias)
        ctx.p, ctx.cast = kept.p, kept.cast  # the tensors go through save_for_backward
        ctx.weight_in_out = weight_in_out
        ctx.input_shape = input.shape
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *kept.tensors())
        return out

    @staticmethod
    def backward(ctx, grad_output):
        weight, probs, packed, value = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.size(-1))
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = weight.t() if ctx.weight_in_out else weight
            grad_input = grad.mm(w).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            kept = KeptAttention(probs, packed, value, ctx.p, ctx.cast)
            context = rebuild_context(kept, ctx.input_shape).view(-1, ctx.input_shape[-1])
            grad_weight = context.t().mm(grad) if ctx.weight_in_out else grad.t().mm(context)
            del context
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias, None, None


@torch.compiler.disable
def project_context(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_in_out: bool = False) -> torch.Tensor | None:
    """The projection through ContextProjectionFunction when `input` is a marked context and a gradient
    is needed; None otherwise (the caller runs its stock forward)."""
    if not torch.is_grad_enabled():
        return None
    kept = kept_for(input)
    if kept is None:
        return None
    return ContextProjectionFunction.apply(input, weight, bias, kept, weight_in_out)


class TempoContextLinear(nn.Linear):
    """nn.Linear after a tempo attention: keeps nothing of its input when it is the attention context.
    Same parameters, forward bits and state_dict."""

    _tempo_base = nn.Linear
    _tempo_technique = "attention"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = project_context(input, self.weight, self.bias)
        return super().forward(input) if out is None else out
