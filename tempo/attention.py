"""softmax -> dropout -> matmul with V, keeping P, a 1-bit dropout mask and V for backward.

Stock attention keeps, per head, the softmax output P (for softmax's backward), the dropout mask (float on
CPU, bool on CUDA) and the dropped-out probabilities D = dropout(P) (for the matmul's backward): 2 or 3
tensors of B*A*S*S. Here D is recomputed in backward from P and the packed mask, which saves b * B*A*S*S
bytes plus the mask's (b or 1) - 1/8.

Forward output and RNG consumption are bit-identical to
    probs = softmax(scores, -1); [probs = probs.to(probs_dtype)]; out = dropout(probs, p) @ value
(tempo.dropout.dropout_with_mask runs stock dropout's own ops), and backward runs the ops stock autograd
runs, in the same order, so gradients match stock's too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .bits import pack
from .dropout import dropout_with_mask, noise_from_bits


@dataclass(frozen=True)
class KeptAttention:
    """What the fused attention keeps for backward, from which its output dropout(P) @ V is rebuilt
    bit for bit (the same ops on the same values): the softmax output P, the packed keep bits, V."""

    probs: torch.Tensor
    packed: torch.Tensor
    value: torch.Tensor
    p: float
    cast: bool  # P was cast to V's dtype before dropout

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.probs, self.packed, self.value

    def noise(self) -> torch.Tensor:
        """Dropout's multiplier (0 or 1 / (1 - p)) in the dtype the probabilities were dropped in."""
        dtype = self.value.dtype if self.cast else self.probs.dtype
        return noise_from_bits(self.packed, self.probs.shape, self.p, dtype, self.probs.device)

    def probs_used(self) -> torch.Tensor:
        return self.probs.to(self.value.dtype) if self.cast else self.probs

    def dropped(self, noise: torch.Tensor | None = None) -> torch.Tensor:
        """dropout(P), as forward computed it."""
        return self.probs_used() * (self.noise() if noise is None else noise)

    def output(self) -> torch.Tensor:
        """dropout(P) @ V, as forward computed it."""
        return torch.matmul(self.dropped(), self.value)


class SoftmaxDropoutMatmulFunction(torch.autograd.Function):
    """(dropout(softmax(scores)) @ value, dropout(softmax(scores)), P, packed keep bits); only the first
    output has a gradient (the last two are what it keeps, handed out for KeptAttention)."""

    @staticmethod
    def forward(ctx, scores, value, p, probs_dtype):
        probs = torch.softmax(scores, dim=-1)
        cast = probs_dtype is not None and probs_dtype != probs.dtype
        probs_used = probs.to(probs_dtype) if cast else probs
        dropped, keep = dropout_with_mask(probs_used, p)
        out = torch.matmul(dropped, value)
        packed = pack(keep)
        ctx.p = p
        ctx.cast = cast
        ctx.scores_dtype = scores.dtype
        ctx.save_for_backward(probs, packed, value)
        ctx.mark_non_differentiable(dropped, probs, packed)
        return out, dropped, probs, packed

    @staticmethod
    def backward(ctx, grad_out, _grad_dropped, _grad_probs, _grad_packed):
        probs, packed, value = ctx.saved_tensors
        kept = KeptAttention(probs, packed, value, ctx.p, ctx.cast)
        noise = kept.noise()
        grad_scores = grad_value = None
        if ctx.needs_input_grad[1]:
            dropped = kept.dropped(noise)
            grad_value = torch.matmul(dropped.transpose(-2, -1), grad_out)
            del dropped
        if ctx.needs_input_grad[0]:
            grad_probs = torch.matmul(grad_out, value.transpose(-2, -1)).mul_(noise)
            if ctx.cast:
                grad_probs = grad_probs.to(probs.dtype)
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, ctx.scores_dtype)
        return grad_scores, grad_value, None, None


def softmax_dropout_matmul(
    scores: torch.Tensor,
    value: torch.Tensor,
    p: float,
    training: bool = True,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout(softmax(scores, -1), p) @ value, the dropped-out probabilities).

    scores: [..., S_q, S_k]; value: [..., S_k, D] with the same leading dims (no broadcasting).
    probs_dtype: cast the probabilities to it before dropout (GPT-2's eager attention casts to V's dtype).
    Falls back to the stock ops when nothing would be kept for backward anyway (eval, p = 0, no grad).
    """
    out, dropped, _ = softmax_dropout_matmul_kept(scores, value, p, training, probs_dtype)
    return out, dropped


def softmax_dropout_matmul_kept(
    scores: torch.Tensor,
    value: torch.Tensor,
    p: float,
    training: bool = True,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, KeptAttention | None]:
    """softmax_dropout_matmul, and what it keeps for backward (None when it fell back to the stock ops)."""
    if scores.shape[:-2] != value.shape[:-2] or scores.shape[-1] != value.shape[-2]:
        raise ValueError(f"scores {tuple(scores.shape)} and value {tuple(value.shape)} do not chain")
    needs_grad = torch.is_grad_enabled() and (scores.requires_grad or value.requires_grad)
    if not training or p == 0.0 or not needs_grad:
        probs = torch.softmax(scores, dim=-1)
        if probs_dtype is not None:
            probs = probs.to(probs_dtype)
        probs = torch.nn.functional.dropout(probs, p, training)
        return torch.matmul(probs, value), probs, None
    out, dropped, probs, packed = SoftmaxDropoutMatmulFunction.apply(scores, value, p, probs_dtype)
    cast = probs_dtype is not None and probs_dtype != probs.dtype
    return out, dropped, KeptAttention(probs, packed, value, p, cast)
