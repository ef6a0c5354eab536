"""JSON from untrusted files: duplicate keys and non-standard constants (NaN, Infinity) refused.

json.loads would silently keep the last of two equal keys and accept NaN/Infinity, which JSON does not have.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import DuplicateKey


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)  # built in C; only a shorter dict means a key came twice
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: "str | bytes") -> Any:
    """``json.loads`` that raises DuplicateKey (a ValueError) naming a key that appears twice in one object,
    and ValueError for NaN, Infinity and -Infinity."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
