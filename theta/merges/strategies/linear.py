"""average and task-arithmetic: linear combinations of the sides (and their task vectors), element by element."""
from __future__ import annotations

from theta.merges.strategies.base import Elementwise


class Average(Elementwise):
    name = "average"
    summary = "alpha·ours + (1−alpha)·theirs"
    defaults = {"alpha": 0.5}

    def prepare(self, name, A, B, O, p):
        alpha = p["alpha"]
        return lambda sl, a, b, o: a * alpha + b * (1.0 - alpha)


class TaskArithmetic(Elementwise):
    name = "task-arithmetic"
    summary = "ancestor + λ_ours·(ours−ancestor) + λ_theirs·(theirs−ancestor)"
    needs_ancestor = uses_ancestor = True
    defaults = {"lambda_ours": 1.0, "lambda_theirs": 1.0}

    def prepare(self, name, A, B, O, p):
        lo, lt = p["lambda_ours"], p["lambda_theirs"]
        return lambda sl, a, b, o: o + (a - o) * lo + (b - o) * lt
