"""auto: per group, the smallest exact representation of a changed value.

The candidates are the exact update types: ``sparse`` (few elements changed), ``delta`` (many elements
moved a little), ``rows`` (rows removed/reordered/appended: the shape changed along the first
dimension) and ``dense`` (the value itself, always possible). Reuse of an unchanged group is decided
before this module is called (same content hash or within tolerance of the previous value).

Cheap estimates first, so that only candidates that can win are encoded in full:

- the number of changed elements ``k`` is counted from the raw bits (one pass, no compression);
  sparse is tried only when ``k`` is at most half of the elements (beyond that delta always wins:
  a sparse element costs its full value plus an index);
- delta and dense are compared on a sample (up to 16 slices of 64 Ki elements spread over the group);
  dense is encoded in full only when its sample is within 10 % of delta's;
- every candidate that is encoded is compressed for real and the smallest blob is kept (only the
  best blob so far is held in memory). The blob is returned, so the caller stores it without
  compressing a second time.

The chosen type is recorded in the group's step, as for any explicitly requested type.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from theta import codec
from theta.updates import Encoded, get
from theta.updates.delta import changed_mask, raw_words, same_layout

SAMPLE_SLICES = 16
SAMPLE_ELEMENTS = 1 << 16
DENSE_MARGIN = 1.10


@dataclass
class Choice:
    update_type: str            # name of the chosen update type (recorded in the Step)
    encoded: Encoded
    blob: bytes                 # codec.encode_parts(encoded.parts, level): what the store keeps
    tried: dict[str, int] = field(default_factory=dict)  # candidate -> blob size, for diagnostics


def _sample(arr: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size <= SAMPLE_SLICES * SAMPLE_ELEMENTS:
        return flat
    starts = np.linspace(0, flat.size - SAMPLE_ELEMENTS, SAMPLE_SLICES).astype(np.int64)
    return np.concatenate([flat[s:s + SAMPLE_ELEMENTS] for s in starts])


def dense_might_win(new: np.ndarray, previous: np.ndarray, level: int) -> bool:
    """Compare delta and dense on a sample of the group (see module docstring)."""
    new_s, prev_s = _sample(new), _sample(previous)
    delta = get("delta").encode(new_s, prev_s)
    delta_size = len(codec.encode_parts(delta.parts, level))
    dense_size = len(codec.encode_parts({"values": new_s}, level))
    return dense_size <= delta_size * DENSE_MARGIN


def changed_count(new: np.ndarray, previous: np.ndarray) -> int:
    return int(np.count_nonzero(changed_mask(new, previous)))


def choose(new: np.ndarray, previous: np.ndarray | None, level: int = codec.DEFAULT_LEVEL) -> Choice:
    """The smallest exact encoding of ``new`` given ``previous`` (None: no previous value)."""
    best: Choice | None = None
    tried: dict[str, int] = {}

    def consider(name: str, encoded: Encoded | None) -> None:
        nonlocal best
        if encoded is None:
            return
        blob = codec.encode_parts(encoded.parts, level)
        tried[name] = len(blob)
        if best is None or len(blob) < len(best.blob):
            best = Choice(name, encoded, blob, tried)

    if same_layout(new, previous):
        k = changed_count(new, previous)
        if 2 * k <= new.size:
            consider("sparse", get("sparse").encode(new, previous))
        if k:
            consider("delta", get("delta").encode(new, previous))
            if dense_might_win(new, previous, level):
                consider("dense", get("dense").encode(new, None))
    else:
        if previous is not None:
            consider("rows", get("rows").encode(new, previous))
        consider("dense", get("dense").encode(new, None))
    assert best is not None  # dense, or sparse/delta on a same-layout group, always encodes
    return best
