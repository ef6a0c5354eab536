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

import torch

from .bits import pack
from .dropout import dropout_with_mask, noise_from_bits


class SoftmaxDropoutMatmulFunction(torch.autograd.Function):
    """(dropout(softmax(scores)) @ value, dropout(softmax(scores))); the second output has no gradient."""

    @staticmethod
    def forward(ctx, scores, value, p, probs_dtype):
        probs = torch.softmax(scores, dim=-1)
        cast = probs_dtype is not None and probs_dtype != probs.dtype
        probs_used = probs.to(probs_dtype) if cast else probs
        dropped, keep = dropout_with_mask(probs_used, p)
        out = torch.matmul(dropped, value)
        ctx.p = p
        ctx.cast = cast
        ctx.scores_dtype = scores.dtype
        ctx.save_for_backward(probs, pack(keep), value)
        ctx.mark_non_differentiable(dropped)
        return out, dropped

    @staticmethod
    def backward(ctx, grad_out, _grad_dropped):
        probs, packed, value = ctx.saved_tensors
        probs_used = probs.to(value.dtype) if ctx.cast else probs
        noise = noise_from_bits(packed, probs_used.shape, ctx.p, probs_used.dtype, probs_used.device)
        grad_scores = grad_value = None
        if ctx.needs_input_grad[1]:
            dropped = probs_used * noise
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
    if scores.shape[:-2] != value.shape[:-2] or scores.shape[-1] != value.shape[-2]:
        raise ValueError(f"scores {tuple(scores.shape)} and value {tuple(value.shape)} do not chain")
    needs_grad = torch.is_grad_enabled() and (scores.requires_grad or value.requires_grad)
    if not training or p == 0.0 or not needs_grad:
        probs = torch.softmax(scores, dim=-1)
        if probs_dtype is not None:
            probs = probs.to(probs_dtype)
        probs = torch.nn.functional.dropout(probs, p, training)
        return torch.matmul(probs, value), probs
    return SoftmaxDropoutMatmulFunction.apply(scores, value, p, probs_dtype)
