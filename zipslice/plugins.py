"""Plugins registered as entry points, with the package's own built-ins known without a scan.

Finding one entry point means importing :mod:`importlib.metadata` (~15 ms, it pulls in the email package) and
reading the ``entry_points.txt`` of every installed distribution (~10 ms per group with 170 distributions, more
in a big environment). git's filter process paid both before the first byte of a `git add` could be hashed, to
find formats and update types it ships itself. So a built-in name resolves straight to its object, and the
entry points are scanned only for another name or a full listing. A plugin cannot replace a built-in: an
installed package registering ``torch`` or ``delta`` is ignored for that name.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Builtin:
    """A built-in, shaped like the entry point that registers it (``name``, ``value``, ``load()``)."""

    name: str
    value: str  # "module:attr"

    def load(self) -> Any:
        module, _, attr = self.value.partition(":")
        return getattr(importlib.import_module(module), attr)


class Registry:
    """The plugins of one entry-point group, beside ``builtins`` (name -> "module:attr")."""

    def __init__(self, group: str, builtins: dict[str, str]):
        self.group = group
        self.builtins = {name: Builtin(name, value) for name, value in builtins.items()}

    def find(self, name: str):
        """The entry point (or built-in) registered as ``name``, or None; scans only for a name not built in."""
        return self.builtins.get(name) or self.installed().get(name)

    def all(self) -> dict:
        """Every registered name -> its entry point: the built-ins, then the installed plugins' other names."""
        return {**self.installed(), **self.builtins}

    def installed(self) -> dict:
        return installed(self.group)


@lru_cache(maxsize=None)
def installed(group: str) -> dict:
    """The installed distributions' entry points of ``group``, name -> entry point (scanned once)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}
