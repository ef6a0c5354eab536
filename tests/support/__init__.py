"""Shared test support: real git/git-lfs environments (gitrepo), small
checkpoints and their comparison (checkpoints, torch_compare), a third-party-style format plugin (npy_plugin).

Import the submodule you need (``from support.gitrepo import GitEnv``): torch-dependent helpers live in their
own modules so zipslice's tests import nothing they do not use.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
