"""The optional packages of the distribution, imported when a call needs one.

``pip install zipslice-theta`` installs neither torch nor the other packages below: every zipslice and theta
command works without them, and so do numpy reads (``lsd.numpy(key)``, ``lsd.get_slice(key,
framework="np")``). A call that does need one goes through :func:`require`, which turns a missing package into
one line naming it, the extra that installs it and what works without it (:class:`MissingDependencyError`).
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import MissingDependencyError

#: top-level module -> the extra of zipslice-theta (pyproject.toml) that installs it
EXTRAS = {"torch": "torch", "zarr": "gittheta", "matplotlib": "plot", "transformers": "hf", "accelerate": "hf"}

#: what reads numpy arrays without torch: the hint of every torch-only accessor
NUMPY_INSTEAD = 'lsd.numpy(key) and lsd.get_slice(key, framework="np")[...] return numpy arrays'


def require(module: str, needed_for: str, instead: str | None = None,
            error: type[MissingDependencyError] = MissingDependencyError, extra: str | None = None) -> ModuleType:
    """``module`` imported, or ``error`` saying that ``needed_for`` needs it (``instead``: what works without;
    ``extra``: the extra to name, default the package's in :data:`EXTRAS`).

    Only the absence of the package itself becomes ``error``; a package that is there but fails to import
    raises its own error (that is a broken install, not a missing extra).
    """
    found = sys.modules.get(module)
    if found is not None:
        return found
    top = module.partition(".")[0]
    try:
        importlib.import_module(top)
    except ModuleNotFoundError as e:
        if e.name != top:
            raise
        raise error(top, needed_for, extra or EXTRAS[top], instead) from None
    return importlib.import_module(module)


def torch(needed_for: str = "lsd[key] returns torch tensors", instead: str | None = NUMPY_INSTEAD) -> ModuleType:
    """The torch module, for a zipslice accessor that returns torch tensors."""
    return require("torch", needed_for, instead)
