"""A theta update type: a group multiplied by one number (a layer rescaled as a whole), stored as that number."""
from __future__ import annotations

import numpy as np

from theta import Encoded


class ScaleUpdate:
    name = "scale"
    incremental = True  # apply() needs the previous value

    def encode(self, new: np.ndarray, previous: np.ndarray | None, **options) -> Encoded | None:
        """The factor that turns ``previous`` into ``new``, or None when no single factor does it exactly."""
        if (previous is None or new.shape != previous.shape or new.dtype != previous.dtype
                or new.dtype.kind != "f" or new.size == 0):
            return None
        before = previous.reshape(-1).astype(np.float64)
        i = int(np.argmax(np.abs(before)))            # the best-conditioned element gives the factor
        if before[i] == 0 or not np.isfinite(before[i]):
            return None
        factor = np.array([new.reshape(-1)[i] / before[i]], dtype=np.float64)
        encoded = Encoded(parts={"factor": factor})
        # theta stores only encodings that rebuild the new value bit for bit: check, or decline
        if self.apply(encoded.parts, encoded.params, previous).tobytes() != new.tobytes():
            return None
        return encoded

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        return (previous.astype(np.float64) * parts["factor"][0]).astype(previous.dtype)
