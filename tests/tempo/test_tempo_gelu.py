"""tempo.gelu: GELU keeping its output + 1 branch bit; GELU'(x) recovered from y (tempo.gelu_slope)."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import tempo  # noqa: E402
from tempo import bits, gelu_slope  # noqa: E402

FORMS = [("none", "erf"), ("tanh", "tanh")]


def _exact_slope(x, approximate):
    """GELU'(x) by float64 autograd at the (rounded) x the forward saw."""
    leaf = x.detach().double().requires_grad_()
    F.gelu(leaf, approximate=approximate).backward(torch.ones_like(leaf))
    return leaf.grad


def _recovered_slope(x, approximate, kind):
    y = F.gelu(x, approximate=approximate)
    packed = bits.pack(gelu_slope.left_of_minimum(x, kind))
    return gelu_slope.gelu_backward_from_output(torch.ones_like(y), y, packed, kind).double()


@pytest.mark.parametrize("approximate,kind", FORMS)
def test_minimum_is_where_the_slope_vanishes(approximate, kind):
    x_min, y_min = gelu_slope.minimum(kind)
    assert abs(_exact_slope(torch.tensor([x_min], dtype=torch.float64), approximate).item()) < 1e-12
    assert y_min == pytest.approx(F.gelu(torch.tensor(x_min, dtype=torch.float64), approximate=approximate).item(), abs=1e-15)
    expected = {"erf": (-0.7517915, -0.1699712), "tanh": (-0.7524614, -0.1700408)}[kind]
    assert (round(x_min, 7), round(y_min, 7)) == expected


@pytest.mark.parametrize("approximate,kind", FORMS)
def test_float32_slope_error_by_region(approximate, kind):
    """The error budget stated in tempo/gelu_slope.py and docs/tempo.md, on 2M points over [-9, 9]: from y
    alone it scales with how far this platform's F.gelu rounds y (k ulp(y*), ~1.5 to ~7.8 by CPU)."""
    k = gelu_slope.forward_rounding(kind)
    x = torch.linspace(-9, 9, 2_000_001, dtype=torch.float64).float()
    err = (_recovered_slope(x, approximate, kind) - _exact_slope(x, approximate)).abs()
    dist = (x.double() - gelu_slope.minimum(kind)[0]).abs()
    assert not torch.isnan(err).any()
    assert err[dist <= 2e-3].max() <= 1e-4 * k       # the floor: float32 y cannot resolve |x - x*| < ~2e-4
    assert err[(dist > 2e-3) & (dist <= 0.05)].max() <= 1.3e-5 * k
    assert err[(dist > 0.05) & (x >= -2)].max() <= 5.5e-7 * k
    # left tail: F.gelu's own float32 y is off by up to ~1e-3 relative there for the erf form
    assert err[x < -2].max() <= (4e-6 if kind == "erf" else 1.5e-6)


@pytest.mark.parametrize("approximate,kind", FORMS)
def test_float64_slope_is_accurate_everywhere(approximate, kind):
    x = torch.linspace(-12, 12, 1_000_001, dtype=torch.float64)
    err = (_recovered_slope(x, approximate, kind) - _exact_slope(x, approximate)).abs()
    assert err.max() <= 5e-8  # the table's interpolation error (and the clamp at |x| ~ 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate,kind", FORMS)
def test_16_bit_floor(dtype, approximate, kind):
    """16-bit y: near x* the floor is ~100x float32's (docs/tempo.md); elsewhere close to stock's own rounding.
    Every finite 16-bit value in [-9, 9] is checked."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = every[torch.isfinite(every) & (every.abs() <= 9)]
    exact = _exact_slope(x, approximate)
    err = (_recovered_slope(x, approximate, kind) - exact).abs()
    stock_err = (_exact_slope(x, approximate).to(dtype).double() - exact).abs().max()
    dist = (x.double() - gelu_slope.minimum(kind)[0]).abs()
    assert err.max() <= 0.02
    assert err[dist > 0.1].max() <= 3 * stock_err
    assert err[dist > 0.3].max() <= 1.5 * stock_err


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_float64(approximate):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: tempo.gelu(t, approximate), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_forward_bit_identical_and_gradient_close(dtype, approximate):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 33, 65, generator=gen) * 2).to(dtype)
    grad = torch.randn(4, 33, 65, generator=gen).to(dtype)
    stock_leaf, ours_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock_out = F.gelu(stock_leaf, approximate=approximate)
    ours_out = tempo.TempoGELU(approximate)(ours_leaf)
    assert torch.equal(stock_out, ours_out)
    stock_out.backward(grad)
    ours_out.backward(grad)
    tolerance = {torch.float32: 2e-4, torch.float64: 1e-7, torch.bfloat16: 6e-2, torch.float16: 3e-2}[dtype]
    torch.testing.assert_close(ours_leaf.grad.double(), stock_leaf.grad.double(), atol=tolerance, rtol=0)


def test_non_contiguous_input():
    x = torch.randn(40, 30).t().requires_grad_()
    ref = x.detach().clone().requires_grad_()
    tempo.gelu(x).backward(torch.ones(30, 40))
    F.gelu(ref).backward(torch.ones(30, 40))
    torch.testing.assert_close(x.grad, ref.grad, atol=2e-4, rtol=0)


def test_extreme_inputs():
    x = torch.tensor([-1e30, -40.0, -6.0, 0.0, 6.0, 40.0, 1e30], requires_grad=True)
    tempo.gelu(x).backward(torch.ones(7))
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 0.0, -3.6e-8, 0.5, 1.0, 1.0, 1.0]), atol=2e-7, rtol=0)


def test_nan_propagates_like_stock():
    x = torch.tensor([float("nan"), float("inf"), 1.0], requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    tempo.gelu(x).backward(torch.ones(3))
    F.gelu(ref).backward(torch.ones(3))
    assert torch.isnan(x.grad[:2]).all() and torch.equal(torch.isnan(x.grad), torch.isnan(ref.grad))
    assert x.grad[2] == pytest.approx(ref.grad[2].item(), abs=1e-6)


def _near(y, kind="erf"):
    return int((y < gelu_slope.near_minimum_threshold(kind, y.dtype)).sum())


def test_keeps_output_bits_and_the_few_stashed_slopes():
    """Saved: y (4 bytes/element) + 1 bit + 8 bytes per element near x*; stock keeps x (4 bytes/element)."""
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ours = tempo.measure(tempo.TempoGELU(), (x,))
    stock = tempo.measure(torch.nn.GELU(), (x,))
    near = _near(F.gelu(x.detach()))
    # ~0.9% x k of N(0, 1) elements: within k ulp(y*) / NEAR_MIN_ERROR ~ 0.015 k of x* (gelu_slope.forward_rounding)
    assert 0 < near < 8000 * 0.012 * gelu_slope.forward_rounding("erf")
    assert stock.total_bytes == 8000 * 4
    assert ours.total_bytes == 8000 * 4 + 1000 + 8 * near


def test_only_float32_stashes():
    x = torch.full((100,), gelu_slope.minimum("erf")[0])
    for dtype, stashed in [(torch.float32, 100), (torch.float64, 0), (torch.bfloat16, 0), (torch.float16, 0)]:
        index, slopes = gelu_slope.stash_near_minimum(x.to(dtype), F.gelu(x.to(dtype)), "erf")
        assert index.numel() == slopes.numel() == stashed
    index, slopes = gelu_slope.stash_near_minimum(x, F.gelu(x), "erf")
    assert index.dtype == torch.int32 and index.tolist() == list(range(100))
    assert slopes.abs().max() < 1e-6


@pytest.mark.parametrize("approximate,kind", FORMS)
def test_float32_gradient_error_with_stash(approximate, kind):
    """Through autograd (stash included) the float32 slope is within 2e-6 everywhere, x* included (just
    outside the stash, sized by gelu_slope.forward_rounding, F.gelu's rounding of y costs ~1e-6)."""
    x = torch.linspace(-9, 9, 2_000_001, dtype=torch.float64).float().requires_grad_()
    tempo.gelu(x, approximate).backward(torch.ones_like(x))
    err = (x.grad.double() - _exact_slope(x, approximate)).abs()
    assert err[x >= -2].max() <= 2e-6
    assert err[x < -2].max() <= (4e-6 if kind == "erf" else 1.5e-6)


def test_output_shared_with_next_linear_counts_once():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), tempo.TempoGELU(), torch.nn.Linear(64, 16))
    stock = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    for a, b in zip(model.parameters(), stock.parameters()):
        b.data = a.data
    x = torch.randn(10, 16)
    ours, theirs = tempo.measure(model, (x,)), tempo.measure(stock, (x,))
    near = _near(model[1](model[0](x)).detach())
    # stock: GELU input + GELU output (kept by the Linear); ours: the output once + 80 bytes of bits + stash
    assert theirs.total_bytes - ours.total_bytes == 640 * 4 - 80 - 8 * near


def test_inplace_change_of_output_is_caught():
    x = torch.randn(10, requires_grad=True)
    y = tempo.gelu(x)
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_grad_is_plain_gelu():
    x = torch.randn(10)
    with torch.no_grad():
        assert torch.equal(tempo.gelu(x), F.gelu(x))


def test_rejects_unknown_form():
    with pytest.raises(ValueError, match="approximate"):
        tempo.gelu(torch.randn(3, requires_grad=True), "sigmoid")
    with pytest.raises(ValueError, match="unknown GELU form"):
        gelu_slope.minimum("quick")
