"""tempo.dropout: same outputs, RNG stream and gradients as F.dropout, with a 1-bit mask kept for backward."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tempo  # noqa: E402
from tempo.bits import packed_size  # noqa: E402


def _run(fn, x, seed):
    torch.manual_seed(seed)
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    after = torch.rand(3)  # the RNG state the op left behind
    return leaf, out, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_bit_identical_to_stock(dtype, p):
    x = torch.randn(64, 33, dtype=torch.float32).to(dtype)
    grad = torch.randn(64, 33).to(dtype)
    leaf_s, out_s, after_s = _run(lambda t: F.dropout(t, p, True), x, 7)
    leaf_t, out_t, after_t = _run(lambda t: tempo.dropout(t, p, True), x, 7)
    assert torch.equal(out_s, out_t)
    assert torch.equal(after_s, after_t)
    out_s.backward(grad)
    out_t.backward(grad)
    assert torch.equal(leaf_s.grad, leaf_t.grad)


def test_keeps_one_bit_per_element():
    x = torch.randn(10, 101, requires_grad=True)
    saved = tempo.measure(tempo.TempoDropout(0.2), (x,))
    assert saved.total_bytes == packed_size(1010)
    stock = tempo.measure(torch.nn.Dropout(0.2), (x,))
    assert stock.total_bytes == 1010 * 4  # the float mask stock keeps on CPU


def test_eval_and_p0_return_the_input_itself():
    x = torch.randn(5, requires_grad=True)
    assert tempo.dropout(x, 0.3, training=False) is x
    assert tempo.dropout(x, 0.0, training=True) is x
    module = tempo.TempoDropout(0.3).eval()
    assert module(x) is x


def test_p1_drops_everything_and_gradient_is_zero():
    x = torch.randn(20, requires_grad=True)
    out = tempo.dropout(x, 1.0, True)
    assert torch.equal(out, torch.zeros(20))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(20))


def test_rejects_bad_probability():
    with pytest.raises(ValueError, match="between 0 and 1"):
        tempo.dropout(torch.randn(3, requires_grad=True), 1.5, True)


def test_inplace_module_runs_stock():
    module = tempo.TempoDropout(0.5, inplace=True)
    x = torch.randn(50)
    torch.manual_seed(3)
    out = module(x)
    assert out is x  # stock in-place semantics
