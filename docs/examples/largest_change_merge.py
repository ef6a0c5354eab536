"""A theta merge strategy: per element, keep the side that moved furthest from the common ancestor."""
from __future__ import annotations

import numpy as np

from zipslice import dtypes


class LargestChange:
    name = "largest-change"
    summary = "per element, the side whose change from the ancestor is larger"
    needs_ancestor = True   # the driver then passes the ancestor's value
    picks = None            # not a strategy that selects one side unchanged
    defaults: dict[str, float] = {}

    def applies(self, dtype: str, has_ancestor: bool) -> bool:
        return has_ancestor and dtypes.get(dtype).kind == "float"

    def merge(self, name: str, ours: np.ndarray, theirs: np.ndarray, ancestor: np.ndarray | None,
              **params: float) -> np.ndarray:
        work = np.float64 if ours.dtype == np.float64 else np.float32   # bfloat16/float16 widen exactly
        base = ancestor.astype(work)
        take_ours = np.abs(ours.astype(work) - base) >= np.abs(theirs.astype(work) - base)
        return np.where(take_ours, ours, theirs)    # same dtype and shape as the inputs
