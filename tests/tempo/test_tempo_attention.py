"""tempo.attention: softmax -> dropout -> matmul keeping P, packed mask and V; stock outputs, RNG, gradients."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tempo  # noqa: E402
from tempo.bits import packed_size  # noqa: E402


def _stock(scores, value, p, probs_dtype=None):
    probs = F.softmax(scores, dim=-1)
    if probs_dtype is not None:
        probs = probs.to(probs_dtype)
    return torch.matmul(F.dropout(probs, p, True), value)


def _ours(scores, value, p, probs_dtype=None):
    return tempo.softmax_dropout_matmul(scores, value, p, True, probs_dtype)[0]


def _run(fn, scores, value, grad, seed, **kw):
    s, v = scores.clone().requires_grad_(), value.clone().requires_grad_()
    torch.manual_seed(seed)
    out = fn(s, v, **kw)
    after = torch.rand(2)
    out.backward(grad)
    return out, after, s.grad, v.grad


def _inputs(dtype=torch.float32, masked=True):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 16, 16, generator=gen) * 3
    if masked:  # HF-style additive mask: the last 5 keys of batch 1 are padding
        scores[1, :, :, -5:] += torch.finfo(torch.float32).min
    value = torch.randn(2, 3, 16, 8, generator=gen)
    grad = torch.randn(2, 3, 16, 8, generator=gen)
    return scores.to(dtype), value.to(dtype), grad.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bit_identical_to_stock(dtype, p):
    scores, value, grad = _inputs(dtype)
    stock = _run(_stock, scores, value, grad, 11, p=p)
    ours = _run(_ours, scores, value, grad, 11, p=p)
    for s, o in zip(stock, ours):
        assert torch.equal(s, o)


def test_cast_probabilities_like_gpt2():
    scores, value, grad = _inputs()
    value, grad = value.to(torch.bfloat16), grad.to(torch.bfloat16)
    stock = _run(_stock, scores, value, grad, 3, p=0.2, probs_dtype=torch.bfloat16)
    ours = _run(_ours, scores, value, grad, 3, p=0.2, probs_dtype=torch.bfloat16)
    for s, o in zip(stock, ours):
        assert torch.equal(s, o)


def test_gradcheck_float64():
    scores, value, _ = _inputs(torch.float64, masked=False)
    scores, value = scores[:1, :2, :5, :5].contiguous(), value[:1, :2, :5, :3].contiguous()

    def fn(s, v):
        torch.manual_seed(5)  # the same mask at every evaluation
        return tempo.softmax_dropout_matmul(s, v, 0.3)[0]

    assert torch.autograd.gradcheck(fn, (scores.requires_grad_(), value.requires_grad_()))


def test_returns_dropped_probabilities_without_gradient():
    scores, value, _ = _inputs()
    torch.manual_seed(1)
    out, dropped = tempo.softmax_dropout_matmul(scores.requires_grad_(), value.requires_grad_(), 0.1)
    torch.manual_seed(1)
    assert torch.equal(dropped, F.dropout(F.softmax(scores.detach(), -1), 0.1, True))
    assert not dropped.requires_grad


def test_eval_no_dropout():
    scores, value, _ = _inputs()
    out, probs = tempo.softmax_dropout_matmul(scores, value.requires_grad_(), 0.5, training=False)
    assert torch.equal(probs, F.softmax(scores, -1))
    assert torch.equal(out, F.softmax(scores, -1) @ value)


def test_keeps_probabilities_bits_and_value():
    """Saved: P, 1 bit per probability, V. Stock: P, the float mask, dropout(P) and V."""
    scores, value, _ = _inputs()
    scores, value = scores.requires_grad_(), value.requires_grad_()

    class Attention(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, s, v):
            return self.fn(s, v, 0.1)

    saved = {name: tempo.measure(Attention(fn), (scores, value)).total_bytes
             for name, fn in (("stock", _stock), ("ours", _ours))}
    n_probs, n_value = scores.numel(), value.numel()
    # the inputs are saved by neither (softmax keeps its output, matmul keeps V and dropout(P))
    assert saved["stock"] == 3 * n_probs * 4 + n_value * 4
    assert saved["ours"] == n_probs * 4 + packed_size(n_probs) + n_value * 4


def test_rejects_shapes_that_do_not_chain():
    with pytest.raises(ValueError, match="do not chain"):
        tempo.softmax_dropout_matmul(torch.randn(2, 4, 4), torch.randn(3, 4, 2), 0.1)
