"""Subcommands of `git theta` contributed by the updates area; theta.cli calls register(app).

    git theta squash PATH...    rewrite the staged version of PATH so every group is self-contained
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List

import typer

from .errors import ThetaError


@dataclass
class SquashReport:
    path: str
    groups: int
    rewritten: int          # groups whose chain had more than one step, or an incremental first step
    new_blob_bytes: int


def squash_meta(meta, store, file: str | None = None):
    """A copy of ``meta`` whose every group is one dense step holding the value its chain rebuilds.

    One group in memory at a time; the rebuilt values are bit for bit what a checkout writes, so the
    working tree stays clean."""
    from .clean import CleanOptions, store_step
    from .updates import content_hash, get, reconstruct

    options = CleanOptions()
    groups, rewritten, before = {}, 0, store.written_bytes
    for name, group in meta.groups.items():
        first = group.steps[0] if group.steps else None
        if len(group.steps) == 1 and not get(first.type).incremental:
            groups[name] = group
            continue
        value = reconstruct(group, store, file=file)
        step = store_step("dense", {"values": value}, {}, content_hash(value), store, options)
        groups[name] = replace(group, steps=[step])
        rewritten += 1
        del value
    return replace(meta, groups=groups), SquashReport(file or "", len(meta.groups), rewritten,
                                                      store.written_bytes - before)


def squash_path(path: str, cwd: str | os.PathLike = ".") -> SquashReport:
    """Squash the staged metadata of ``path`` (a theta-tracked checkpoint) and stage the result."""
    from . import gitutil
    from .lfs_transfer import fetch_missing
    from .metadata import dumps, is_metadata, loads
    from .store import LfsStore

    top = gitutil.toplevel(cwd)
    rel = os.path.relpath(Path(cwd, path).resolve(), top).replace(os.sep, "/")
    data = gitutil.read_blob(f":{rel}", top)
    if data is None:
        raise ThetaError(f"{path}: not in the index; `git add` it first")
    if not is_metadata(data):
        raise ThetaError(f"{path}: the staged version is not theta metadata (is the path tracked with "
                         f"`git theta track`?)")
    meta = loads(data)
    store = LfsStore.for_repo(top)
    fetch_missing(top, meta.blob_refs(), store=store)
    squashed, report = squash_meta(meta, store, file=rel)
    if report.rewritten:
        text = dumps(squashed).encode("utf-8")  # stored as is: it already is the clean form
        oid = gitutil.run(["hash-object", "-w", "--no-filters", "--stdin"], top, input=text).decode().strip()
        mode = gitutil.run_text(["ls-files", "-s", "--", rel], top).split()[0]
        gitutil.run(["update-index", "--cacheinfo", f"{mode},{oid},{rel}"], top)
    report.path = rel
    return report


def register(app: typer.Typer) -> None:
    """Add this area's commands to the `git theta` app."""

    @app.command()
    def squash(paths: List[str] = typer.Argument(..., help="Theta-tracked checkpoints to squash.")) -> None:
        """Make the staged version of each PATH self-contained: every group becomes one dense step.

        Update chains (sparse/low-rank/ia3/delta/rows steps on earlier values) are rebuilt and stored as
        plain values, so the next commit no longer needs the older blobs. The working tree is unchanged.
        """
        for p in paths:
            r = squash_path(p)
            if r.rewritten:
                print(f"squashed {r.path}: {r.rewritten} of {r.groups} groups made self-contained "
                      f"({r.new_blob_bytes / 2**20:.1f} MiB stored); the result is staged")
            else:
                print(f"{r.path}: already self-contained ({r.groups} groups)")
