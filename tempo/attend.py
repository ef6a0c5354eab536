"""Eager attention with tempo's fused tail: the one path every attention tempo takes over runs.

    scores = query @ keyᵀ * scaling (+ additive mask); out = dropout(softmax(scores), p) @ value

with softmax -> dropout -> matmul through tempo.attention (keeps P, 1-bit mask, V) and the context laid out
[B, S, A, D], contiguous, marked (tempo.context) so the output projection rebuilds it in backward instead of
keeping it. These are the ops, in the order, of Hugging Face's eager attention for BERT, RoBERTa and GPT-2,
so forward, RNG use and gradients are stock eager's bit for bit.
"""
from __future__ import annotations

import torch

from .attention import KeptAttention, softmax_dropout_matmul_kept
from .context import mark_context


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    p: float,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, KeptAttention | None]:
    """(context [B, S_q, A, D] marked for the projection, dropout(P), what is kept; None when the stock ops ran).

    query, key, value: [B, A, S, D] with the same leading dims; mask: additive, broadcasting to the scores
    [B, A, S_q, S_k] (Hugging Face's eager masks: 0 where attended, the dtype's minimum elsewhere).
    probs_dtype: cast P to it before dropout (GPT-2's eager attention casts to V's dtype).
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling
    if mask is not None:
        scores = scores + mask
    output, weights, kept = softmax_dropout_matmul_kept(scores, value, p, True, probs_dtype)
    return mark_context(output.transpose(1, 2).contiguous(), kept), weights, kept
