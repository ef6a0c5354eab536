"""`git theta add --from SOURCE PATH`: record the checkpoint at SOURCE as the new version of the tracked PATH.

SOURCE is any checkpoint zipslice reads -- in particular a sharded checkpoint (its ``*.index.json``), such as
the shards ``git theta export HEAD:PATH out/model.safetensors.index.json`` wrote and a user then edited. git
cannot check one tracked path out as several files (docs/guide/format-views.md, "Sharded views"), so
this is the way back from shards to the single committed file.

SOURCE is read as a view of PATH's committed version (:func:`theta.model.views.clean_as_committed`): PATH keeps its
committed format, structure, names, file metadata and ties; only the values of the groups that differ are
stored. Whatever the committed format cannot hold is refused naming the group, before anything is written
or staged. Then PATH in the work tree is rewritten (in its checkout format, as any checkout would write it)
and staged with `git add`, so the work tree, the index and `git status` agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from theta.base.errors import ThetaError
from theta.git import repo as gitutil


@dataclass(frozen=True)
class AddedFrom:
    path: str              # PATH, relative to the top of the work tree
    format: str            # the format PATH is recorded in
    changed: list[str]     # groups whose value differs from the committed version (all, for a new file)


def add_from(source: str | os.PathLike, path: str | os.PathLike, cwd: str | os.PathLike = ".",
             fmt: str | None = None, git_args: list[str] | None = None, progress: bool | None = None) -> AddedFrom:
    """Record ``source`` as ``path``'s new version (see the module docstring); ``fmt``: record it in this
    format instead of the committed one (`git theta add --format`); ``git_args``: more `git add` options."""
    import zipslice
    from zipslice.errors import ZipsliceError

    from theta import settings
    from theta.commands.export import default_mode
    from theta.model.smudge import smudge_checkpoint
    from theta.storage.committed import committed_meta
    from theta.storage.store import LfsStore
    from theta.storage.transfer import fetch_missing
    from theta.model.views import clean_as_committed

    top = Path(gitutil.toplevel(cwd))
    full = Path(cwd, path).resolve()
    src = Path(cwd, source).resolve()
    rel = os.path.relpath(full, top).replace(os.sep, "/")
    if rel.startswith("../"):
        raise ThetaError(f"{path}: outside the repository at {top}")
    if gitutil.check_attr("filter", [rel], top).get(rel) != "theta":
        raise ThetaError(f"{rel} is not tracked by theta (`git theta track PATTERN` first)")
    if not src.exists():
        raise ThetaError(f"--from {source}: no such file")
    if src == full:
        raise ThetaError(f"--from {source} is {rel} itself: use `git add {rel}`")
    committed = committed_meta(rel, top)
    if committed is None and fmt is None:
        try:
            if zipslice.sniff(src) == "sharded":
                raise ThetaError(f"{rel} has no committed version to record {source} in: a sharded checkpoint "
                                 f"becomes one file in a format you choose: add --format FORMAT")
        except ZipsliceError:
            pass  # clean_as_committed reports an unreadable source, naming it
    store = LfsStore.for_repo(top)
    show = settings.stderr_is_terminal() if progress is None else progress
    options = settings.clean_options(top, progress=show)
    meta = clean_as_committed(src, store, committed, options, fmt, name=rel)
    if committed is not None:
        fetch_missing(top, committed.blob_refs(), store=store)  # the unchanged groups, to write PATH in full
    smudge_checkpoint(meta, store, full, fmt=settings.checkout_format(rel, top), progress=show)
    default_mode(full)
    env = dict(os.environ)
    if fmt is not None:
        env[settings.ENV_PREFIX + "FORMAT"] = fmt
    status = 0
    if gitutil.read_blob(f":{rel}", top) is not None:
        # as `git theta add --format`: clean PATH again even if its stat data happened to match the index's
        status = gitutil.passthrough(["add", "--renormalize", *(git_args or []), "--", rel], cwd=top, env=env)
    if status == 0:
        status = gitutil.passthrough(["add", *(git_args or []), "--", rel], cwd=top, env=env)
    if status != 0:
        raise ThetaError(f"git add {rel} failed (exit {status}); {rel} in the work tree holds {source}'s values")
    changed = sorted(n for n in meta.groups
                     if committed is None or n not in committed.groups or committed.groups[n].hash != meta.groups[n].hash)
    return AddedFrom(rel, meta.format, changed)
