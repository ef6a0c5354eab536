"""`git theta fsck`: is every blob the metadata needs present with its hash, and does every group's chain
rebuild to its recorded hash (:mod:`theta.model.fsck`); repairs by refetching from the remote."""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import List, Optional

import typer

from zipslice.clistyle import JSON_OPTION, emit_json, printable
from zipslice.progress import Bar, human_bytes


def problem_lines(problems) -> list[str]:
    """One line per bad blob (naming every file, group and version that needs it) and per broken chain or
    unreadable metadata text."""
    merged: "OrderedDict[tuple, list]" = OrderedDict()
    for p in problems:
        key = (p.kind, p.oid, p.detail, p.repaired) if p.oid else (p.kind, p.file, p.group, p.detail, p.repaired, id(p))
        merged.setdefault(key, []).append(p)
    lines = []
    for ps in merged.values():
        p = ps[0]
        state = "repaired " if p.repaired else ""
        if p.oid:
            users: "OrderedDict[tuple, list[str]]" = OrderedDict()
            for q in ps:
                users.setdefault((q.file, q.group), []).append(q.where)
            needed = "; ".join(f"{f} group {g!r} ({', '.join(dict.fromkeys(w))})" for (f, g), w in users.items())
            lines.append(printable(f"{state}{p.kind}: blob {p.oid} ({human_bytes(p.size)}): {p.detail}; "
                                  f"needed by {needed}"))
        else:
            group = f" group {p.group!r}" if p.group else ""
            lines.append(printable(f"{state}{p.kind}: {p.file} ({p.where}){group}: {p.detail}"))
    return lines


def fsck(revs: Optional[List[str]] = typer.Argument(None, help="Revisions to check (default: local refs, "
                                                    "index, stash, unpushed history)."),
         pointers: bool = typer.Option(False, "--pointers", help="Check the metadata texts only."),
         repair: bool = typer.Option(False, "--repair", help="Refetch missing and corrupt blobs from the "
                                     "remote (corrupt ones are moved to <lfs>/theta-quarantine first)."),
         remote: Optional[str] = typer.Option(None, "--remote", help="Remote to repair from."),
         as_json: bool = JSON_OPTION,
         ) -> None:
    """Check that every blob the metadata needs is present with its sha256, and that every group's chain
    rebuilds to its recorded hash. Exit status 1 on any problem left."""
    from theta.model.fsck import fsck as run_fsck  # (numpy: `git theta -h` and hooks stay light)

    with Bar("fsck") as bar:
        report = run_fsck(revs=list(revs or []), pointers_only=pointers, repair=repair, remote=remote,
                          on_bytes=bar.advance)
    if as_json:
        emit_json(report.to_json())
    else:
        for line in problem_lines(report.problems):
            print(line)
        what = "metadata text(s)" if pointers else (f"metadata text(s), {report.groups} group chain(s), "
                                                   f"{report.blobs} blob(s) ({human_bytes(report.bytes)})")
        left = len(problem_lines([p for p in report.problems if not p.repaired]))
        verdict = "OK" if report.ok else f"{left} problem(s)"
        extra = f", {report.repaired} blob(s) refetched" if report.repaired else ""
        print(f"checked {report.files} {what}: {verdict}{extra}", file=sys.stderr)
        if not report.ok and not repair and any(p.kind in ("missing", "corrupt") for p in report.problems):
            print("`git theta fsck --repair` refetches missing and corrupt blobs from the remote", file=sys.stderr)
    raise typer.Exit(0 if report.ok else 1)
