"""How far a patched module's gradients are from exact, next to stock's own error: the check that tempo
changes gradients by rounding only.

`gradient_errors(stock, patched, x, grad_output)` runs one forward and backward of each module, and of a
float64 copy of `stock` as the reference, from the same seed (so dropout draws the same masks: CPU
`bernoulli_` draws alike in any dtype), and returns, for every parameter and for the input, the relative
L2 error of stock's gradient and of the patched one's against the reference.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

INPUT = "(input)"


@dataclass(frozen=True)
class GradientError:
    """Relative L2 errors against float64 of one gradient (`name`: a parameter's, or "(input)")."""

    name: str
    reference_norm: float
    stock: float
    patched: float


def gradients(module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, seed: int = 5) -> dict[str, torch.Tensor]:
    """Gradients of every parameter of `module` and of `x` (key "(input)"), as float64, for one forward
    of module(x) (x and grad_output cast to the module's dtype; a tuple output's first element is used)
    seeded with `seed`, backpropagating `grad_output`. Leaves `.grad` of the parameters untouched."""
    named = list(module.named_parameters())
    names, params = [name for name, _ in named], [p for _, p in named]
    dtype = params[0].dtype if params else x.dtype
    inp = x.detach().to(dtype).requires_grad_()
    torch.manual_seed(seed)
    out = module(inp)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, (inp, *params), grad_output.to(out.dtype), allow_unused=True)
    result = {name: (g if g is not None else torch.zeros_like(p)).double()
              for name, p, g in zip(names, params, grads[1:])}
    result[INPUT] = grads[0].double()
    return result


def gradient_errors(stock: nn.Module, patched: nn.Module, x: torch.Tensor, grad_output: torch.Tensor,
                    seed: int = 5) -> list[GradientError]:
    """Per gradient, the relative L2 error of `stock`'s and of `patched`'s against a float64 copy of
    `stock` (same parameters, same seed). `patched` must hold the same parameters as `stock` (e.g. a
    deep copy passed to tempo.patch). A gradient that is zero in exact arithmetic gives errors relative to
    rounding noise: its reference_norm says so."""
    reference = gradients(copy.deepcopy(stock).double(), x, grad_output, seed)
    theirs = gradients(stock, x, grad_output, seed)
    ours = gradients(patched, x, grad_output, seed)
    rows = []
    for name, exact in reference.items():
        norm = exact.norm()
        rows.append(GradientError(name, norm.item(), ((theirs[name] - exact).norm() / norm).item(),
                                  ((ours[name] - exact).norm() / norm).item()))
    return rows
