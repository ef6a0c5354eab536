"""The distribution's version, for ``zipslice.__version__``, ``theta.__version__`` and ``--version``.

From the installed package's metadata (one version for the whole distribution); a source checkout that is
not installed reads ``pyproject.toml`` beside the packages instead.
"""
from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "zipslice-theta"


@functools.lru_cache(maxsize=None)
def package_version() -> str:
    """The version of the ``zipslice-theta`` distribution this code belongs to ("0+unknown" if none)."""
    here = Path(__file__).resolve().parent.parent
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None and _same_tree(dist, here):
        return dist.version
    pyproject = here / "pyproject.toml"
    if pyproject.is_file():
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"))
        if m:
            return m.group(1)
    return dist.version if dist is not None else "0+unknown"


def _same_tree(dist: metadata.Distribution, here: Path) -> bool:
    """Whether the installed metadata describes this copy of the code (not another checkout's editable
    install, nor a copy that a source tree's pyproject.toml describes better)."""
    try:
        located = Path(dist.locate_file("zipslice")).resolve()
    except (TypeError, NotImplementedError):
        return True
    return located == here / "zipslice" or not (here / "pyproject.toml").is_file()
