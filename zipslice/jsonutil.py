"""JSON from untrusted files: duplicate keys refused (json.loads would silently keep the last one)."""
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


def loads_strict(text: "str | bytes") -> Any:
    """``json.loads`` that raises DuplicateKey (a ValueError) naming a key that appears twice in one object."""
    return json.loads(text, object_pairs_hook=_no_duplicates)
