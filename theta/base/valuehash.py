"""The content hash that names a group's value (``GroupMeta.hash``, ``Step.hash``): one home for its two forms.

- ``blake3:<64 hex digits>``: BLAKE3-256 of the value's little-endian bytes. Every value theta hashes anew
  is named this way: BLAKE3 hashes ~3.5x faster than sha256 here (0.66 against 2.35 ms per 4 MiB frame, one
  core with AVX-512), and a `git add` of changed groups hashes every changed byte once
  (docs/design/performance.md, "Change detection").
- ``<64 hex digits>``: sha256 of the same bytes, as metadata written before BLAKE3 names values. Such names
  are kept as long as the value is: a group whose bytes did not change keeps its name (so the metadata of an
  unchanged checkpoint keeps its bytes and `git status` stays clean), and every check of a value against
  its name (checkout, fsck, a chain rebuilt) hashes with the algorithm the name says (:func:`like`).

Two names in different forms never compare equal as text, even for the same value: what compares names
(merges, diffs) then sees a change where the value went back to one named before BLAKE3, does the work a
change needs, never less, and decides by the values it reads (theta.merges.plan.value_equal, theta.model.diff).
Blobs keep sha256 names: their oid is git-lfs's.
"""
from __future__ import annotations

import hashlib
import re

import blake3
import numpy as np

PREFIX = "blake3:"
_FORM = re.compile(r"(?:blake3:)?[0-9a-f]{64}")


class Hasher:
    """A value hash being computed: :meth:`update` with contiguous bytes of any item size (numpy arrays
    included), :meth:`hexdigest` the name."""

    __slots__ = ("_h", "_prefix")

    def __init__(self, h, prefix: str):
        self._h, self._prefix = h, prefix

    def update(self, data) -> None:
        if isinstance(data, np.ndarray):
            data = data.reshape(-1).view(np.uint8)  # (bfloat16 and float8 have no buffer format)
        view = memoryview(data)
        self._h.update(view if view.format == "B" and view.ndim == 1 else view.cast("B"))

    def hexdigest(self) -> str:
        return self._prefix + self._h.hexdigest()


def new(data=None) -> Hasher:
    """A hasher for a value named now (BLAKE3); releases the GIL on large updates, as hashlib does."""
    h = Hasher(blake3.blake3(max_threads=1), PREFIX)
    if data is not None:
        h.update(data)
    return h


def like(name: str) -> Hasher:
    """A hasher of the algorithm ``name`` is in (to check a value against it)."""
    return Hasher(hashlib.sha256(), "") if not name.startswith(PREFIX) else new()


def is_name(v) -> bool:
    """Whether ``v`` is a value name in either form."""
    return isinstance(v, str) and _FORM.fullmatch(v) is not None


def is_blake3(name: str) -> bool:
    return name.startswith(PREFIX)


def label(name: str) -> str:
    """``name`` with its algorithm spelled out, for people (``sha256:...`` or ``blake3:...``)."""
    return name if is_blake3(name) else "sha256:" + name
