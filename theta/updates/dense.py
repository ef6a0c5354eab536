"""Dense update: the whole value, self-contained."""
from __future__ import annotations

import numpy as np

from theta.updates import Encoded


class DenseUpdate:
    name = "dense"
    incremental = False

    def encode(self, new: np.ndarray, previous: np.ndarray | None = None, **options) -> Encoded:
        return Encoded(parts={"values": new}, params={})

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None = None) -> np.ndarray:
        return parts["values"]
