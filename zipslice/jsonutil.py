"""JSON from untrusted files: duplicate keys and non-standard constants (NaN, Infinity) refused.

json.loads would silently keep the last of two equal keys and accept NaN/Infinity, which JSON does not have.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import DuplicateKey


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: "str | bytes") -> Any:
    """``json.loads`` that raises DuplicateKey (a ValueError) naming a key that appears twice in one object,
    and ValueError for NaN, Infinity and -Infinity."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
