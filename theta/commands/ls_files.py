"""`git theta ls-files [REV]`: the theta-tracked checkpoints of a revision (default: the index) with format, group
count, size, stored size and whether every blob is local (:mod:`theta.storage.tracked`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import typer

from zipslice import clistyle
from zipslice.clistyle import JSON_OPTION, QUIET_OPTION, emit_json, natural_key, note, set_quiet
from zipslice.progress import human_bytes as human


def ls_files(rev: Optional[str] = typer.Argument(None, metavar="REV", help="A revision (default: the index)."),
             as_json: bool = JSON_OPTION, quiet: bool = QUIET_OPTION) -> None:
    """Theta-tracked checkpoints with format, group count, size, stored size and whether every blob is local."""
    from theta.storage.tracked import list_tracked  # (numpy: `git theta -h` and hooks stay light)

    set_quiet(quiet)
    files = sorted(list_tracked(rev), key=lambda f: natural_key(f.path))
    if as_json:  # size: bytes of the groups' values; stored: bytes of the distinct blobs that rebuild it
        emit_json({"rev": rev, "files": [dataclasses.asdict(f) for f in files]})
        return
    if not files:
        note("no theta-tracked checkpoints")
        return
    rows = [["format", "groups", "size", "blobs", "local", "path"]]
    rows += [[f.format, str(f.groups), human(f.size), human(f.stored), "yes" if f.local else "no",
              clistyle.printable(f.path)] for f in files]
    lines = clistyle.columns(rows, right=(1, 2, 3))
    if not clistyle.is_quiet():
        clistyle.out_console().print(lines[0], style="bold", markup=False)
    for line in lines[1:]:
        print(line)
