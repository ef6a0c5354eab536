"""GELU'(x) from y = GELU(x) and one branch bit (x < x*), without keeping x.

GELU has one minimum, (x*, y*) = (-0.7517915, -0.1699712) for the erf form and (-0.7524614, -0.1700408)
for the tanh form, so y alone does not fix x: one bit per element says which side of the minimum x was on.
On each side the slope is a smooth function of a variable of y:
- right (x >= x*): r = sqrt(y - y*). It removes the square-root kink at the minimum; x > 6 (r > ~2.48)
  is clamped there (GELU' = 1 within 4e-8).
- left (x < x*): w = sqrt(-2 log(y / y*)). Near the minimum w ~ sqrt(y - y*) (no kink), and as
  x -> -inf w ~ |x|, which tames the Gaussian tail; x below ~-5.9 is clamped (|GELU'| < 1e-7).
Each variable indexes a table of 8192 linear cells per side (two flat gathers, start and rise, and one
fused multiply-add; no branches): ~20 elementwise ops per element in all, in place in buffers reused
across chunks. The tables are built on first use from the exact GELU in
float64: each node's x by bisection, then GELU'(x) exactly. No polynomial fit, Newton step, erf or exp
runs per element.

Near x*, y itself cannot say where x was: float32 rounds y to ~1.5e-8, which hides |x - x*| below ~2e-4
(the slope error from y alone rises as ~e / |x - x*|, with e the forward's own rounding of y: k ulp(y*),
k from ~1.5 to ~7.6 by CPU, :func:`forward_rounding`). Those elements are few (|x - x*| < 0.015 k: ~1% of
a BERT layer's at k = 1.5, ~7% at 7.6), so for float32 the forward also keeps their exact slope and
flat index (`stash_near_minimum`: 8 bytes each) and backward puts them back. 16-bit y is not stashed: its
floor (~1.5e-2 near x*, docs/tempo.md) would need ~10% of the elements kept.

Accuracy, float32 (tests/tempo/test_tempo_gelu.py measures it): within ~2e-6 of GELU'(x) everywhere
with the stash (just outside it, F.gelu's rounding of y costs up to ~1e-6), within ~6e-7 (at k = 1.5)
farther than 0.05 from x*, except
- x < -2 for the erf form: F.gelu's own float32 y carries up to ~1e-3 relative error there (1 + erf
  cancels), so the slope is off by up to ~3.5e-6 (slopes there are below 0.09 in size).
Work is done in float32 (float64 stays float64) in chunks that stay in cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .bits import unpack_float

KINDS = ("erf", "tanh")
# Elements per chunk: its float32 temporaries stay cache-resident; a multiple of 8 so chunks start on whole
# bytes of packed bits. Measured on a 2-core AMD EPYC, one thread: 2^16 .. 2^18 alike, 2^15 ~30 % slower
# (Python overhead per op), 2^20 ~2x slower (out of cache).
CHUNK = 1 << 17
# Linear cells per side: interpolation error h^2 |slope''| / 8 < 3e-8 (|slope''| <= 2.4 in r, 0.33 in w).
CELLS = 8192
# Largest slope error tolerated from y alone near x* in float32; closer elements have their slope stashed.
NEAR_MIN_ERROR = 1e-6
X_RIGHT_CLAMP = 6.0
X_LEFT_CLAMP = -6.5

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="none" if kind == "erf" else "tanh")


def _gelu_slope(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Exact GELU'(x) in float64."""
    if kind == "erf":
        return torch.special.ndtr(x) + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    th = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * x * x)


def _log_neg_gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    """log(-GELU(x)) for x < 0, without underflow in the far tail."""
    if kind == "erf":
        return torch.log(-x) + torch.special.log_ndtr(x)
    return torch.log(-x) + torch.nn.functional.logsigmoid(2.0 * _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3))


def _bisect(fn, target: torch.Tensor, lo: float, hi: float, increasing: bool, steps: int = 56) -> torch.Tensor:
    """x in [lo, hi] with fn(x) = target, fn monotone in the given direction, elementwise in float64
    (56 halvings of an interval <= 9 wide: 1.3e-16, below float64 resolution there)."""
    lo_t = torch.full_like(target, lo)
    hi_t = torch.full_like(target, hi)
    for _ in range(steps):
        mid = 0.5 * (lo_t + hi_t)
        go_right = (fn(mid) < target) if increasing else (fn(mid) > target)
        lo_t = torch.where(go_right, mid, lo_t)
        hi_t = torch.where(go_right, hi_t, mid)
    return 0.5 * (lo_t + hi_t)


@dataclass(frozen=True)
class _Form:
    x_min: float
    y_min: float
    y_min_hi: float  # y* as float32 hi + lo: y - y* in two float32 ops with ~float64 accuracy
    y_min_lo: float
    curvature: float  # GELU''(x*)
    r_max: float
    w_max: float
    cells: torch.Tensor  # float64 (2 * CELLS, 2): right cells, then left cells; [slope at s = 0, at s = 1]


@lru_cache(maxsize=None)
def _form(kind: str) -> _Form:
    if kind not in KINDS:
        raise ValueError(f"unknown GELU form {kind!r}; expected one of {KINDS}")
    f64 = torch.float64
    x_min = float(_bisect(lambda x: _gelu_slope(x, kind), torch.zeros(1, dtype=f64), -1.5, -0.2, True)[0])
    y_min = float(_gelu(torch.tensor(x_min, dtype=f64), kind))
    h = 1e-5
    around = _gelu_slope(torch.tensor([x_min - h, x_min + h], dtype=f64), kind)
    curvature = float((around[1] - around[0]) / (2 * h))
    log_neg_y_min = math.log(-y_min)

    def right_var(x):
        return torch.sqrt(torch.clamp(_gelu(x, kind) - y_min, min=0.0))

    def left_var(x):
        return torch.sqrt(torch.clamp(-2.0 * (_log_neg_gelu(x, kind) - log_neg_y_min), min=0.0))

    r_max = float(right_var(torch.tensor(X_RIGHT_CLAMP, dtype=f64)))
    w_max = float(left_var(torch.tensor(X_LEFT_CLAMP, dtype=f64)))

    def cells(var, v_max, lo, hi, increasing):
        v = torch.arange(CELLS + 1, dtype=f64) * (v_max / CELLS)
        slope = _gelu_slope(_bisect(var, v, lo, hi, increasing), kind)
        return torch.stack([slope[:-1], slope[1:]], dim=1)

    table = torch.cat([cells(right_var, r_max, x_min, X_RIGHT_CLAMP + 1.0, increasing=True),
                       cells(left_var, w_max, X_LEFT_CLAMP - 1.0, x_min, increasing=False)])
    y_min_hi = float(torch.tensor(y_min, dtype=torch.float32))
    return _Form(x_min=x_min, y_min=y_min, y_min_hi=y_min_hi, y_min_lo=float(torch.tensor(y_min - y_min_hi, dtype=torch.float32)),
                 curvature=curvature, r_max=r_max, w_max=w_max, cells=table)


@lru_cache(maxsize=None)
def _cells(kind: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slope at each cell's start, its rise across the cell), flat: two 1-D gathers are ~4x cheaper on
    CPU than one gather of 2-element rows, and start + frac * rise is one fused op."""
    cells = _form(kind).cells
    start, rise = cells[:, 0], cells[:, 1] - cells[:, 0]  # the rise from float64 ends: one rounding
    return start.to(dtype=dtype, device=device).contiguous(), rise.to(dtype=dtype, device=device).contiguous()


def minimum(kind: str) -> tuple[float, float]:
    """(x*, y*) of the GELU form `kind` ('erf' or 'tanh')."""
    form = _form(kind)
    return form.x_min, form.y_min


def left_of_minimum(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The branch bit the backward needs: x < x*."""
    return x < _form(kind).x_min


def _ulp_of_y_min(kind: str) -> float:
    return math.ldexp(1.0, math.frexp(abs(_form(kind).y_min))[1] - 24)


@lru_cache(maxsize=None)
def forward_rounding(kind: str, device_type: str = "cpu") -> float:
    """How far this platform's float32 GELU (F.gelu, whose y the backward gets) rounds y near x*, in ulp(y*),
    at least 1: measured once per process on 8193 points within 0.05 of x*, against float64.

    It depends on torch's kernel, so on the CPU: ~1.5 with AVX-512, ~7.8 (erf form) and ~2.4 (tanh) with
    AVX2 (torch 2.13, both measured); the slope error from y alone scales with it."""
    x_min = _form(kind).x_min
    x = torch.linspace(x_min - 0.05, x_min + 0.05, 8193, dtype=torch.float64, device=device_type)
    y = _gelu(x.float(), kind).double()
    return max(1.0, float((y - _gelu(x.float().double(), kind)).abs().max()) / _ulp_of_y_min(kind))


def near_minimum_threshold(kind: str, dtype: torch.dtype, device_type: str = "cpu") -> float | None:
    """y below this (float32 only) is too close to y* for y to fix the slope within NEAR_MIN_ERROR.

    The slope error from y alone at distance d from x* is ~e / d, with e the forward's rounding of y
    (:func:`forward_rounding` ulp(y*)), so d = e / NEAR_MIN_ERROR, i.e. y - y* < GELU''(x*) d^2 / 2.
    """
    if dtype != torch.float32:
        return None
    form = _form(kind)
    distance = forward_rounding(kind, device_type) * _ulp_of_y_min(kind) / NEAR_MIN_ERROR
    return form.y_min + 0.5 * form.curvature * distance * distance


def stash_near_minimum(x: torch.Tensor, y: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices, exact slopes) of the elements whose slope y cannot fix: float32 y near y*.

    Empty for other dtypes. Indices are int32 when they fit, in ascending order.
    """
    threshold = near_minimum_threshold(kind, y.dtype, y.device.type)
    if threshold is None:
        return torch.zeros(0, dtype=torch.int32, device=y.device), y.new_zeros(0)
    flat = y.detach().reshape(-1)
    if flat.device.type == "cpu":  # numpy's compare + flatnonzero: ~4x faster than torch's nonzero on CPU
        index = torch.from_numpy(np.flatnonzero(flat.numpy() < threshold))
    else:
        index = (flat < threshold).nonzero().squeeze(1)
    slopes = _gelu_slope(x.reshape(-1).index_select(0, index).double(), kind).to(y.dtype)
    if y.numel() < 2**31:
        index = index.to(torch.int32)
    return index, slopes


class _Workspace:
    """Chunk-sized buffers reused by every chunk of one backward: a fresh 512 KiB temporary per op costs
    ~10x the op itself on CPU (glibc gives such blocks back to the kernel on free, so every allocation
    faults its pages in again)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        padded = (numel + 7) // 8 * 8
        self.position = torch.empty(numel, dtype=dtype, device=device)
        self.squared = torch.empty(numel, dtype=dtype, device=device)
        self.start = torch.empty(numel, dtype=dtype, device=device)
        self.rise = torch.empty(numel, dtype=dtype, device=device)
        self.left = torch.empty(padded, dtype=dtype, device=device)
        self.index = torch.empty(numel, dtype=torch.int32, device=device)

    def sized(self, numel: int) -> "_Workspace":
        view = object.__new__(_Workspace)
        for name, buffer in vars(self).items():
            setattr(view, name, buffer if name == "left" else buffer[:numel])
        return view


def slope_from_output(y: torch.Tensor, left: torch.Tensor, kind: str, work: _Workspace | None = None) -> torch.Tensor:
    """GELU'(x) for one flat chunk: y float32 or float64, `left` 1.0 where x < x*, 0.0 elsewhere (y's dtype).

    Both sides' variables are formed squared and blended by `left` (lerp: exact at 0 and 1) before one
    sqrt; each is clamped into its table first, so the side not taken stays finite. ~20 ops per element,
    all in place in `work`'s buffers (allocated if not given); the result is one of them.
    """
    form = _form(kind)
    start, rise = _cells(kind, y.dtype, y.device)
    if work is None:
        work = _Workspace(y.numel(), y.dtype, y.device)
    right_scale, left_scale = CELLS / form.r_max, CELLS / form.w_max
    tiny = torch.finfo(y.dtype).eps / 2
    u = torch.sub(y, form.y_min_hi, out=work.position).sub_(form.y_min_lo)  # y - y*
    # left, squared and scaled to cells: w^2 = -2 log(y / y*) = -2 log1p(u / y*); u / y* >= -1 there.
    # Keeping it above -1 keeps log1p finite (sqrt of inf is slow on CPU); it caps x near -5.9 in float32.
    squared = torch.mul(u, 1.0 / form.y_min, out=work.squared).clamp_(-1.0 + tiny, 0.0).log1p_()
    squared.mul_(-2.0 * left_scale**2)
    position = u.clamp_min_(0.0).mul_(right_scale**2).lerp_(squared, left).sqrt_().clamp_max_(CELLS - 1e-2)
    # row: floor first, then the left offset (adding CELLS first could round 19.9997 + 8192 up to 8212)
    row = torch.floor(position, out=work.squared).add_(left, alpha=CELLS)
    index = work.index.copy_(row).clamp_(0, 2 * CELLS - 1)  # NaN: any row...
    torch.index_select(start, 0, index, out=work.start)
    torch.index_select(rise, 0, index, out=work.rise)
    # ...but frac(NaN) = NaN, as stock would give
    return torch.addcmul(work.start, position.frac_(), work.rise, out=work.squared)


def gelu_backward_from_output(
    grad_output: torch.Tensor,
    y: torch.Tensor,
    packed_left: torch.Tensor,
    kind: str,
    near_index: torch.Tensor | None = None,
    near_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad_output * GELU'(x), from the saved output y, the packed branch bits (bits.pack(x < x*)) and,
    optionally, the exact slopes `stash_near_minimum` kept (they replace the recovered ones).

    16-bit tensors are computed in float32 and rounded once at the end, as PyTorch's own GELU backward does.
    """
    _form(kind)
    if grad_output.shape != y.shape:
        raise ValueError(f"shape mismatch: grad {tuple(grad_output.shape)}, output {tuple(y.shape)}")
    compute_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    grad_input = torch.empty(y.shape, dtype=grad_output.dtype, device=y.device)
    flat_out = grad_input.view(-1)
    flat_y, flat_grad = y.reshape(-1), grad_output.reshape(-1)
    numel = flat_y.numel()
    starts = list(range(0, numel, CHUNK))
    stashed = near_index is not None and near_index.numel() > 0
    if stashed:  # where each chunk's stashed elements begin and end (indices are ascending)
        edges = torch.tensor(starts + [numel], dtype=near_index.dtype, device=near_index.device)
        bounds = torch.searchsorted(near_index, edges).tolist()
    work = _Workspace(min(CHUNK, numel), compute_dtype, y.device)
    same_dtype = grad_output.dtype == compute_dtype
    for chunk, start in enumerate(starts):
        stop = min(start + CHUNK, numel)
        here = work if stop - start == CHUNK else work.sized(stop - start)
        left = unpack_float(packed_left[start // 8:(stop + 7) // 8], stop - start, compute_dtype, out=here.left)
        slope = slope_from_output(flat_y[start:stop].to(compute_dtype), left, kind, here)
        if stashed and bounds[chunk] < bounds[chunk + 1]:
            a, b = bounds[chunk], bounds[chunk + 1]
            slope.index_copy_(0, near_index[a:b].long() - start, near_slopes[a:b].to(compute_dtype))
        if same_dtype:
            torch.mul(slope, flat_grad[start:stop], out=flat_out[start:stop])
        else:  # 16-bit: product in float32, rounded once
            flat_out[start:stop] = slope.mul_(flat_grad[start:stop].to(compute_dtype))
    return grad_input
