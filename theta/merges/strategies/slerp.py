"""SLERP: spherical interpolation of the two sides (two passes: the angle first, then the result)."""
from __future__ import annotations

import math

import numpy as np

from theta.merges.strategies.base import Elementwise, chunks_side_by_side, work_dtype

# slerp falls back to linear interpolation when |cos θ| exceeds this (vectors nearly parallel)
SLERP_PARALLEL = 0.9995



class Slerp(Elementwise):
    name = "slerp"
    summary = "spherical interpolation from ours (t=0) to theirs (t=1); linear when nearly parallel"
    defaults = {"t": 0.5}
    ranges = {"t": (0.0, 1.0, True)}  # an interpolation: beyond [0, 1] sin((1-t)θ) gives finite garbage

    def prepare(self, name, A, B, O, p):
        t = p["t"]
        wd = work_dtype(A)
        dot = na = nb = 0.0  # the first pass: the angle, from chunks of CHUNK summed in order
        for _, a, b in chunks_side_by_side(A, B):
            a, b = a.astype(np.float64), b.astype(np.float64)
            dot += float(a @ b)
            na += float(a @ a)
            nb += float(b @ b)
        ca, cb = 1.0 - t, t
        if na > 0 and nb > 0:
            cos = max(-1.0, min(1.0, dot / math.sqrt(na * nb)))
            if abs(cos) <= SLERP_PARALLEL:
                theta = math.acos(cos)
                ca = math.sin((1.0 - t) * theta) / math.sin(theta)
                cb = math.sin(t * theta) / math.sin(theta)
        ca, cb = wd.type(ca), wd.type(cb)
        return lambda sl, a, b, o: a * ca + b * cb
