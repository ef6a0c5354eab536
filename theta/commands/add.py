"""`git theta add`: `git add` with clean options (they reach the filter as GIT_THETA_* environment variables),
`--format` to change the committed format, and `--from SOURCE PATH` to record another checkpoint as PATH.

``--from``: SOURCE is any checkpoint zipslice reads -- in particular a sharded checkpoint (its ``*.index.json``),
such as the shards ``git theta export HEAD:PATH out/model.safetensors.index.json`` wrote and a user then edited.
git cannot check one tracked path out as several files (docs/guide/format-views.md, "Sharded views"), so this is
the way back from shards to the single committed file. SOURCE is read as a view of PATH's committed version
(:func:`theta.model.views.clean_as_committed`): PATH keeps its committed format, structure, names, file metadata
and ties; only the values of the groups that differ are stored. Whatever the committed format cannot hold is
refused naming the group, before anything is written or staged. Then PATH in the work tree is rewritten (in its
checkout format, as any checkout would write it) and staged with `git add`, so the work tree, the index and
`git status` agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer

from theta.base.errors import ThetaError
from theta.git import repo as gitutil
from zipslice import clistyle, formats
from zipslice.clistyle import note, say


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


# -- the verb -------------------------------------------------------------------------------------

def add(ctx: typer.Context,
        paths: List[str] = typer.Argument(..., metavar="PATH", help="Paths to add (and any `git add` options)."),
        update_type: Optional[str] = typer.Option(None, "--update-type", metavar="TYPE",
                                                  help="dense, sparse, low-rank, ia3, delta, rows or auto."),
        update_data: Optional[Path] = typer.Option(None, "--update-data", "--update-path", metavar="FILE",
                                                   help="A file holding the update (side-loaded; Git-Theta's "
                                                        "README spells it --update-path)."),
        option: List[str] = typer.Option([], "--option", "-o", metavar="KEY=VALUE",
                                         help="A clean option, passed to the filter as GIT_THETA_KEY."),
        checkpoint_type: Optional[str] = typer.Option(None, "--checkpoint-type", hidden=True,
                                                      help="Git-Theta's option: theta reads the format from the "
                                                           "file's bytes; use --format to change the committed one."),
        format: Optional[str] = typer.Option(None, "--format", metavar="FORMAT",
                                             help="Change the committed format to torch, safetensors or hdf5 "
                                                  "(whatever format the work-tree file has).",
                                             **clistyle.one_of(formats.one_file_writable, "format")),
        source: Optional[Path] = typer.Option(None, "--from", metavar="SOURCE",
                                              help="Record the checkpoint at SOURCE (any format, e.g. a sharded "
                                                   "model.safetensors.index.json) as PATH's new version; PATH "
                                                   "is rewritten in the work tree."),
        ) -> None:
    """`git add` with clean options; they reach the filter as GIT_THETA_* environment variables.

    A file keeps the format it was committed in, whatever format it is checked out in (a view); `--format`
    is the one way to change it: the paths are cleaned again (`git add --renormalize`) and recorded as FORMAT.
    `--from SOURCE PATH` records another checkpoint (e.g. shards written by `git theta export`) as PATH, in
    PATH's committed format.
    """
    if source is not None:
        _add_from(source, paths, format, ctx.args, update_type or update_data or option)
        return
    env = dict(os.environ)
    if checkpoint_type:
        note(f"note: --checkpoint-type {checkpoint_type} is not needed: theta detects the checkpoint format "
             f"from the file (use --format to change the committed format)")
    if update_type:
        from theta import updates

        known = ["auto", *updates.names()]
        if update_type not in known:  # as Git-Theta's argparse choices: refused before git runs
            raise ThetaError(f"--update-type {update_type!r}: expected one of {', '.join(known)}")
    if update_type and update_data:
        # Git-Theta's workflow: the work tree may hold the ORIGINAL checkpoint; make it previous-with-update
        from theta.peers.gittheta.add_update import prepare

        for message in prepare([p for p in paths if not p.startswith("-")], update_type, update_data):
            note(message)
    if update_type:
        env["GIT_THETA_UPDATE_TYPE"] = update_type
    if update_data:
        env["GIT_THETA_UPDATE_DATA"] = str(update_data.resolve())
    for kv in option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {kv!r}", param_hint="'--option'")
        env["GIT_THETA_" + key.upper().replace("-", "_")] = value
    if format is not None:
        env["GIT_THETA_FORMAT"] = format
        # a tracked file whose stat matches the index would not be cleaned again by a plain `git add`
        status = gitutil.passthrough(["add", "--renormalize", *ctx.args, "--", *paths], env=env)
        if status != 0:
            raise typer.Exit(status)
    raise typer.Exit(gitutil.exec_or_passthrough(["add", *ctx.args, *paths], env=env))


def _add_from(source: Path, paths: List[str], fmt: Optional[str], git_args: List[str], other: object) -> None:
    if len(paths) != 1:
        raise typer.BadParameter(f"--from records one checkpoint as one PATH; got {len(paths)} paths",
                                 param_hint="'PATH'")
    if other:
        raise typer.BadParameter("--from takes no --update-type, --update-data or --option: SOURCE is cleaned "
                                 "as the file's next version with the repository's settings", param_hint="'--from'")
    done = add_from(source, paths[0], os.getcwd(), fmt, git_args)
    say(f"staged {done.path} ({done.format}) from {source}: {len(done.changed)} changed group"
        f"{'' if len(done.changed) == 1 else 's'}")
