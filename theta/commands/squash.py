"""`git theta squash PATH...`: rewrite the staged version of PATH so every group is self-contained (one dense step;
:mod:`theta.model.squash`); the work tree is unchanged."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, List

import typer

from theta.base.errors import ThetaError
from theta.git import repo as gitutil
from zipslice.clistyle import say, set_quiet

if TYPE_CHECKING:  # the model layer is imported when a command runs, not when `git theta` starts
    from theta.model.squash import SquashReport


def squash_path(path: str, cwd: str | os.PathLike = ".") -> "SquashReport":
    """Squash the staged metadata of ``path`` (a theta-tracked checkpoint) and stage the result."""
    from theta.model.squash import squash_meta
    from theta.storage.transfer import fetch_missing
    from theta.storage.metadata import dumps, is_metadata, loads
    from theta.storage.store import LfsStore

    top = gitutil.toplevel(cwd)
    rel = os.path.relpath(Path(cwd, path).resolve(), top).replace(os.sep, "/")
    data = gitutil.read_blob(f":{rel}", top)
    if data is None:
        raise ThetaError(f"{path}: not in the index; `git add` it first")
    if not is_metadata(data):
        raise ThetaError(f"{path}: the staged version is not theta metadata (is the path tracked with "
                         f"`git theta track`?)")
    meta = loads(data, file=rel)
    if meta.is_opaque:
        raise ThetaError(f"{path}: not a checkpoint (stored as one opaque blob); nothing to squash")
    store = LfsStore.for_repo(top)
    fetch_missing(top, meta.blob_refs(), store=store)
    squashed, report = squash_meta(meta, store, file=rel)
    if report.rewritten:
        text = dumps(squashed, file=rel).encode("utf-8")  # stored as is: it already is the clean form
        oid = gitutil.run(["hash-object", "-w", "--no-filters", "--stdin"], top, input=text).decode().strip()
        mode = gitutil.run_text(["ls-files", "-s", "--", rel], top).split()[0]
        gitutil.run(["update-index", "--cacheinfo", f"{mode},{oid},{rel}"], top)
    report.path = rel
    return report


# -- the verbs ------------------------------------------------------------------------------------

def squash(paths: List[str] = typer.Argument(..., metavar="PATH", help="Theta-tracked checkpoints to squash."),
           quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors.")) -> None:
    """Make the staged version of each PATH self-contained: every group becomes one dense step.

    Update chains (sparse/low-rank/ia3/delta/rows steps on earlier values) are rebuilt and stored as
    plain values, so the next commit no longer needs the older blobs. The working tree is unchanged.
    """
    set_quiet(quiet)
    for p in paths:
        r = squash_path(p)
        if r.rewritten:
            say(f"squashed {r.path}: {r.rewritten} of {r.groups} groups made self-contained "
                  f"({r.new_blob_bytes / 2**20:.1f} MiB stored); the result is staged")
        else:
            say(f"{r.path}: already self-contained ({r.groups} groups)")
