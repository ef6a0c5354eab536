"""`git theta merge-manual`, `merge-resolve`, `merge-strategies`, and git's merge driver (`merge-driver`, hidden);
the driver's work is in :mod:`theta.commands.merge_driver` (and its interactive menu in
:mod:`theta.commands.merge_menu`), imported when a command runs (numpy: `git theta -h` and the hooks stay light)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from theta.base.errors import MergeConflict, ThetaError
from theta.git import repo as gitutil
from zipslice.clistyle import JSON_OPTION, QUIET_OPTION, emit_json, note, set_quiet


def merge_driver(ancestor: str = typer.Argument(..., metavar="%O"), ours: str = typer.Argument(..., metavar="%A"),
                 theirs: str = typer.Argument(..., metavar="%B"),
                 marker_size: str = typer.Argument("7", metavar="%L"),
                 path: str = typer.Argument("checkpoint", metavar="%P")) -> None:
    """git's merge driver: `git-theta merge-driver %O %A %B %L %P` (result written over %A)."""
    from theta.commands.merge_driver import main

    raise typer.Exit(main(ancestor, ours, theirs, marker_size, path))


def merge_manual(path: str = typer.Argument(..., metavar="PATH",
                                            help="A checkpoint left in conflict by `git merge`."),
                 to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                                  help="Write torch, safetensors or hdf5 instead."),
                 quiet: bool = QUIET_OPTION) -> None:
    """Write the ours/theirs/ancestor versions of a conflicted checkpoint beside it to merge by hand.

    Merge them with any tool, write the result to PATH, then `git add PATH` and commit.
    """
    from theta.commands.export import export

    set_quiet(quiet)
    p = Path(path)
    stem, suffix = (p.name[:-len("".join(p.suffixes))], "".join(p.suffixes)) if p.suffixes else (p.name, "")
    repo_path = gitutil.run_text(["ls-files", "--full-name", "--", path], check=False).splitlines()
    if not repo_path:
        raise ThetaError(f"{path}: not in the index (is it a conflicted, theta-tracked checkpoint?)")
    written = []
    for stage, role in ((2, "ours"), (3, "theirs"), (1, "ancestor")):
        out = p.with_name(f"{stem}.{role}{suffix}")
        if not gitutil.object_exists(f":{stage}:{repo_path[0]}"):
            if stage == 1:
                continue  # added on both sides: no ancestor
            raise ThetaError(f"{path}: no stage {stage} ({role}) in the index; is the file in conflict?")
        export(f":{stage}:{repo_path[0]}", out, fmt=to)
        written.append(str(out))
    for w in written:
        print(w)
    note(f"Merge them into {path}, then `git add {path}` and commit.")


def merge_resolve(path: str = typer.Argument(..., metavar="PATH",
                                             help="A checkpoint left in conflict by `git merge`."),
                  strategy: str = typer.Option(..., "--strategy", "-s", metavar="NAME",
                                               help="A merge strategy: average, ties, ours, ... "
                                                    "(`git theta merge-strategies` lists them)."),
                  param: List[str] = typer.Option([], "--param", "-p", metavar="NAME=VALUE",
                                                  help="A strategy parameter, e.g. density=0.3."),
                  quiet: bool = QUIET_OPTION) -> None:
    """Resolve a conflicted checkpoint with a merge strategy: write the result and stage it (then commit)."""
    from theta.commands.merge_driver import resolve_conflicted

    set_quiet(quiet)
    params = {}
    for kv in param:
        key, sep, value = kv.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected NAME=VALUE, got {kv!r}", param_hint="'--param'")
        params[key.strip().replace("-", "_")] = value
    try:
        resolve_conflicted(path, strategy, params)
    except MergeConflict as e:
        raise ThetaError(str(e)) from None
    note(f"Resolved {path} with {strategy}; staged. Commit to conclude the merge.")


def merge_strategies(as_json: bool = JSON_OPTION) -> None:
    """List the installed merge strategies and their parameters."""
    from theta.merges import get, names

    found = [get(name) for name in names()]
    if as_json:
        emit_json({"strategies": [{"name": s.name, "summary": s.summary, "parameters": dict(s.defaults),
                                   "needs_ancestor": s.needs_ancestor} for s in found]})
        return
    for name, s in zip(names(), found):
        params = ", ".join(f"{k}={v:g}" for k, v in s.defaults.items())
        print(f"{name:<16} {s.summary}" + (f"  [{params}]" if params else ""))
