"""tempo.context: the attention output projection rebuilds the context from what the attention keeps."""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tempo  # noqa: E402
from tempo.attention import softmax_dropout_matmul_kept  # noqa: E402
from tempo.context import TempoContextLinear, kept_for, mark_context, project_context  # noqa: E402

B, A, S, D = 2, 3, 5, 4


def _attention(scores, value, p=0.3, seed=0):
    """The marked context [B, S, A*D] and the KeptAttention, as tempo.hf's attention hands them over."""
    torch.manual_seed(seed)
    out, _, kept = softmax_dropout_matmul_kept(scores, value, p)
    context = mark_context(out.transpose(1, 2).contiguous(), kept)
    return context.reshape(B, S, A * D), kept


def _inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(B, A, S, S, generator=gen, dtype=dtype, requires_grad=True)
    value = torch.randn(B, A, S, D, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(6, A * D, generator=gen, dtype=dtype, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=dtype, requires_grad=True)
    return scores, value, weight, bias


@pytest.mark.parametrize("weight_in_out", [False, True])
def test_gradcheck_through_attention_and_projection(weight_in_out):
    scores, value, weight, bias = _inputs()
    if weight_in_out:  # HF Conv1D: weight [in, out]
        weight = weight.detach().t().contiguous().requires_grad_()

    def fn(scores, value, weight, bias):
        context, kept = _attention(scores, value)
        out = project_context(context, weight, bias, weight_in_out)
        assert out is not None and out.grad_fn.name() == "ContextProjectionFunctionBackward"
        return out

    assert torch.autograd.gradcheck(fn, (scores, value, weight, bias))


def test_forward_and_gradients_bit_identical_to_linear():
    scores, value, weight, bias = _inputs(torch.float32)
    linear = nn.Linear(A * D, 6)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    ours = copy.deepcopy(linear)
    ours.__class__ = TempoContextLinear
    results = []
    for module in (linear, ours):
        s, v = scores.detach().clone().requires_grad_(), value.detach().clone().requires_grad_()
        context, _ = _attention(s, v)
        out = module(context)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), s.grad, v.grad, module.weight.grad, module.bias.grad))
    assert ours(context).grad_fn.name() == "ContextProjectionFunctionBackward"
    for stock, tempo_ in zip(*results):
        assert torch.equal(stock, tempo_)


def test_keeps_nothing_new():
    scores, value, weight, bias = _inputs(torch.float32)

    class Run(nn.Module):
        def __init__(self, projection):
            super().__init__()
            self.projection = projection

        def forward(self, scores, value):
            return self.projection(_attention(scores, value)[0])

    linear = nn.Linear(A * D, 6)
    stock = tempo.measure(Run(linear), (scores, value)).by_path()
    linear.__class__ = TempoContextLinear
    ours = tempo.measure(Run(linear), (scores, value)).by_path()
    assert stock == {"(root)": 4 * B * A * S * S + (B * A * S * S + 7) // 8 + 4 * B * A * S * D,  # P, bits, V
                     "projection": 4 * B * S * A * D}                                          # the context
    assert ours == {"(root)": stock["(root)"]}


def test_falls_back_unless_an_untouched_marked_context_with_grad():
    scores, value, weight, bias = _inputs(torch.float32)
    context, kept = _attention(scores, value)
    assert kept_for(context) is kept
    assert kept_for(context.detach().clone()) is None              # not the marked tensor
    assert kept_for(context.transpose(0, 1)) is None               # not its contiguous layout
    assert kept_for(context[:1]) is None                           # part of it
    with torch.no_grad():
        assert project_context(context, weight, bias) is None       # nothing to keep
    changed, _ = _attention(scores, value)
    changed.mul_(2)                                                 # rebuilt values would be stale
    assert kept_for(changed) is None
    torch.manual_seed(0)
    _, _, none = softmax_dropout_matmul_kept(scores, value, 0.3, training=False)
    assert none is None and mark_context(torch.zeros(1), none).__dict__ == {}


def test_frozen_projection_still_passes_gradients_through():
    scores, value, weight, bias = _inputs(torch.float32)
    grads = []
    for project in (lambda c: torch.nn.functional.linear(c, weight.detach(), bias.detach()),
                    lambda c: project_context(c, weight.detach(), bias.detach())):
        s, v = scores.detach().clone().requires_grad_(), value.detach().clone().requires_grad_()
        context, _ = _attention(s, v)
        project(context).sum().backward()
        grads.append((s.grad, v.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
