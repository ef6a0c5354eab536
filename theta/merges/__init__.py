"""Merge strategies for parameter groups changed on both sides of a `git merge`.

Strategies are plugins registered under the entry-point group ``theta.merges`` (the built-ins in
:mod:`theta.merges.strategies` use the same mechanism, see pyproject.toml, and are found without scanning the
entry points: :mod:`zipslice.plugins`). A strategy is a class with::

    name: str                       # entry-point name, e.g. "ties"
    summary: str                    # one line for menus and `git theta merge-strategies`
    needs_ancestor: bool            # True when the math uses the common ancestor
    picks: str | None               # "ours" / "theirs" / "ancestor" when it selects one side unchanged
    defaults: dict[str, float]      # parameters and their default values
    def applies(self, dtype: str, has_ancestor: bool) -> bool
    def merge(self, name, ours, theirs, ancestor, **params) -> numpy.ndarray

``merge`` gets whole groups as numpy arrays of the group's dtype (ml_dtypes for bfloat16/float8) and returns
an array of the same dtype and shape.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zipslice.plugins import Registry

from theta.base.errors import MergeError

ENTRY_POINT_GROUP = "theta.merges"
_REGISTRY = Registry(ENTRY_POINT_GROUP, {  # in menu order
    "ours": "theta.merges.strategies.pick:Ours", "theirs": "theta.merges.strategies.pick:Theirs",
    "ancestor": "theta.merges.strategies.pick:Ancestor", "average": "theta.merges.strategies.linear:Average",
    "task-arithmetic": "theta.merges.strategies.linear:TaskArithmetic", "ties": "theta.merges.strategies.sparsified:Ties",
    "dare": "theta.merges.strategies.sparsified:Dare", "slerp": "theta.merges.strategies.slerp:Slerp"})
_BUILTIN = tuple(_REGISTRY.builtins)


@runtime_checkable
class MergeStrategy(Protocol):
    """A merge strategy for groups changed on both sides (see the module docstring for each member).

    ``merge`` receives the three values with the group's real dtype (``ancestor`` is None when
    ``needs_ancestor`` is False) and returns the merged array of the same dtype and shape.
    """

    name: str
    summary: str
    needs_ancestor: bool
    picks: str | None
    defaults: dict[str, float]

    def applies(self, dtype: str, has_ancestor: bool) -> bool: ...

    def merge(self, name: str, ours: np.ndarray, theirs: np.ndarray, ancestor: np.ndarray | None,
              **params: Any) -> np.ndarray: ...


def _entry_points() -> dict[str, Any]:
    """The installed plugins' entry points (scanned once)."""
    return _REGISTRY.installed()


def names() -> list[str]:
    """Names of every registered strategy, built-ins first in their documented order."""
    return list(_BUILTIN) + sorted(n for n in _REGISTRY.all() if n not in _BUILTIN)


@lru_cache(maxsize=None)
def get(name: str) -> MergeStrategy:
    """The strategy registered as ``name``; unknown names raise MergeError listing the known ones."""
    ep = _REGISTRY.find(name)
    if ep is None:
        raise MergeError(f"unknown merge strategy {name!r}; known: {', '.join(names())}")
    obj = ep.load()
    strategy = obj() if isinstance(obj, type) else obj
    if not isinstance(strategy, MergeStrategy):
        raise MergeError(f"merge strategy {name!r} ({ep.value}) does not implement the MergeStrategy protocol")
    return strategy


def applicable(dtype: str, has_ancestor: bool) -> list[str]:
    """Names of the strategies that can merge a group of ``dtype`` (with or without an ancestor)."""
    return [n for n in names() if get(n).applies(dtype, has_ancestor)]
