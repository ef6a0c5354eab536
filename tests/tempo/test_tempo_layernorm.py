"""tempo.layernorm: LayerNorm keeping its output and rstd; x_hat kept for columns where gamma is tiny or
|beta| >> |gamma| (the released Tempo divided by gamma there: NaN/Inf dx with gamma = 0)."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tempo  # noqa: E402
from tempo.layernorm import columns_to_keep  # noqa: E402


def _grads(fn, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves]


def _stock(x, w, b, eps=1e-12):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _ours(x, w, b, eps=1e-12):
    return tempo.layer_norm(x, x.shape[-1:], w, b, eps)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _errors_vs_float64(x, weight, bias, grad):
    """Relative L2 error of (dx, dgamma, dbeta) against float64 stock, for stock float32 and ours."""
    _, ref = _grads(_stock, x.double(), weight.double(), bias.double(), grad.double())
    _, stock = _grads(_stock, x, weight, bias, grad)
    _, ours = _grads(_ours, x, weight, bias, grad)
    return [_rel(s, r) for s, r in zip(stock, ref)], [_rel(o, r) for o, r in zip(ours, ref)]


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 768, generator=gen) * 3 + 1
    weight = 1 + 0.1 * torch.randn(768, generator=gen)
    bias = 0.1 * torch.randn(768, generator=gen)
    grad = torch.randn(4, 32, 768, generator=gen)
    return x, weight, bias, grad


def test_forward_bit_identical_and_eps_honoured(data):
    x, weight, bias, _ = data
    for eps in (1e-12, 1e-5, 0.5):
        assert torch.equal(_stock(x, weight, bias, eps), _ours(x.requires_grad_(), weight, bias, eps))


def test_gradients_within_3x_stock_error(data):
    stock, ours = _errors_vs_float64(*data)
    for s, o in zip(stock, ours):
        assert o <= 3 * s + 1e-9


def test_three_zero_gammas(data):
    """3 of 768 gamma at 0: every dx element was NaN/Inf in the released Tempo."""
    x, weight, bias, grad = data
    weight = weight.clone()
    weight[[5, 300, 767]] = 0.0
    out, grads = _grads(_ours, x, weight, bias, grad)
    assert all(torch.isfinite(g).all() for g in grads)
    stock, ours = _errors_vs_float64(x, weight, bias, grad)
    for s, o in zip(stock, ours):
        assert o <= 3 * s + 1e-9
    assert columns_to_keep(weight, bias).tolist() == [5, 300, 767]


@pytest.mark.parametrize("gamma", [1e-6, 1e-3])
def test_tiny_gamma_with_bias_keeps_dgamma_accurate(data, gamma):
    """gamma = 1e-6 gave 1e-3 relative error in dgamma in the released Tempo."""
    x, weight, bias, grad = data
    weight = weight.clone()
    weight[:64] = gamma
    stock, ours = _errors_vs_float64(x, weight, bias, grad)
    for s, o in zip(stock, ours):
        assert o <= 3 * s + 1e-9


def test_huge_beta(data):
    x, weight, bias, grad = data
    bias = bias.clone()
    bias[::7] = 1e4
    stock, ours = _errors_vs_float64(x, weight, bias, grad)
    for s, o in zip(stock, ours):
        assert o <= 3 * s + 1e-9
    assert torch.equal(columns_to_keep(weight, bias), torch.arange(0, 768, 7))


def test_columns_to_keep_rule():
    weight = torch.tensor([1.0, 0.0, 1e-35, 0.5, -2.0, 1.0])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.6, 1.9, -1.5])
    assert columns_to_keep(weight, bias).tolist() == [1, 2, 3, 5]
    assert columns_to_keep(weight, bias, ratio=2.0).tolist() == [1, 2]
    assert columns_to_keep(weight, None).tolist() == [1, 2]
    assert columns_to_keep(None, None).tolist() == []


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_gradcheck_float64(affine, bias):
    gen = torch.Generator().manual_seed(2)
    module = torch.nn.LayerNorm((3, 5), eps=1e-5, elementwise_affine=affine, bias=bias).double()
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.randn(3, 5, generator=gen, dtype=torch.float64))
            module.weight[0, 0] = 0.0  # a kept column
            if bias:
                module.bias.copy_(torch.randn(3, 5, generator=gen, dtype=torch.float64))
    module.__class__ = tempo.TempoLayerNorm
    x = torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    params = tuple(p for p in module.parameters())
    assert torch.autograd.gradcheck(lambda t, *p: module(t), (x, *params))


def test_keeps_output_and_rstd():
    """Saved: y (shared with the next Linear) + rstd (+ kept columns); stock keeps x, mean, rstd."""
    ln = torch.nn.LayerNorm(64)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64))
    x = torch.randn(10, 64, requires_grad=True)
    stock = tempo.measure(model, (x,))
    model[0].__class__ = tempo.TempoLayerNorm
    ours = tempo.measure(model, (x,))
    assert stock.total_bytes - ours.total_bytes == 640 * 4 + 10 * 4  # input and mean gone
    with torch.no_grad():
        model[0].weight[:3] = 0.0
    kept = tempo.measure(model, (x,))
    assert kept.total_bytes - ours.total_bytes == 10 * 3 * 4 + 3 * 8  # 3 kept columns + their int64 indices
    del ln


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit(dtype, data):
    x, weight, bias, grad = (t.to(dtype) for t in data)
    out_s, stock = _grads(_stock, x, weight, bias, grad)
    out_o, ours = _grads(_ours, x, weight, bias, grad)
    assert torch.equal(out_s, out_o)
    for s, o in zip(stock, ours):
        assert _rel(o, s) < 2e-2


def test_no_grad_is_plain_layer_norm(data):
    x, weight, bias, _ = data
    with torch.no_grad():
        assert torch.equal(_ours(x, weight, bias), _stock(x, weight, bias))
