"""Entry points as an installed distribution declares them, for code that is not (re)installed yet.

``declared_site(tmp)`` writes a throwaway ``*.dist-info`` holding this checkout's ``zipslice.formats`` entry
points (from pyproject.toml); put the directory on sys.path / PYTHONPATH and importlib.metadata finds them,
exactly as after ``pip install``.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from . import ROOT


def declared_site(base: Path, group: str = "zipslice.formats") -> Path:
    entries = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][group]
    site = Path(base) / "plugin-site"
    info = site / "zipslice_theta_checkout-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zipslice-theta-checkout\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    return site
