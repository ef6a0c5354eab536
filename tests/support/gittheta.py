"""Comparing what theta checks out with what the real Git-Theta 0.2.0 checked out (fixtures/git_theta/**/
expected.json, recorded by fixtures/git_theta/make_fixtures.py while Git-Theta ran: per commit, per file, per
tensor its dtype, shape and the sha256 of its little-endian bytes)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

import zipslice

from support.gitrepo import Repo


def le_sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def checked_out(path: Path) -> dict[str, np.ndarray]:
    with zipslice.load(path) as ck:
        return {k: np.array(ck.numpy(k)) for k in ck.keys()}


def key_paths(path: Path) -> dict[str, list[str]]:
    """``{name: path of dict keys}`` of a torch checkpoint's container tree."""
    from theta.peers.gittheta.files import key_paths as paths

    with zipslice.load(path) as ck:
        return {k: list(v) for k, v in paths(ck.structure).items()}


def assert_matches_git_theta(repo: Repo, commit: dict) -> None:
    """Every file of ``commit`` holds what Git-Theta checked out: names, nesting, dtypes, shapes, bytes."""
    for f, groups in commit["files"].items():
        got = checked_out(repo / f)
        assert sorted(got) == sorted(groups), f
        paths = key_paths(repo / f)
        for name, want in groups.items():
            assert paths[name] == want.get("key", [name]), (f, name)  # nested as Git-Theta nests it
            assert str(got[name].dtype) == want["dtype"], (f, name)
            assert list(got[name].shape) == want["shape"], (f, name)
            assert le_sha256(got[name]) == want["sha256"], (commit["subject"], f, name)
