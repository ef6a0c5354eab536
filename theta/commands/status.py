"""`git theta status`: each theta-tracked checkpoint of the index, materialized or placeholder, its blobs, size,
format and the staged change against HEAD (the facts come from :mod:`theta.storage.tracked`)."""
from __future__ import annotations

import sys

import typer

from zipslice.clistyle import JSON_OPTION, emit_json, printable
from zipslice.progress import human_bytes

# why a placeholder is one, when no checkout recorded its failure (theta.commands.filter.handoff)
UNRECORDED = ("the work tree holds its metadata text: checked out with GIT_THETA_SKIP_SMUDGE or theta.skipSmudge, "
              "by a git without theta, or by a checkout that did not finish")


def status(as_json: bool = JSON_OPTION) -> None:
    """Each theta-tracked checkpoint: materialized or placeholder, blobs local/missing, size, format,
    and the staged change against HEAD in groups. Exit status 1 while a file holds a placeholder that
    should be its checkpoint (unless theta.skipSmudge / GIT_THETA_SKIP_SMUDGE asks for placeholders)."""
    from theta import settings  # (numpy: `git theta -h` and hooks stay light)
    from theta.storage.tracked import PLACEHOLDER, repo_status

    files = repo_status()
    _explain(files)
    missing = [] if settings.checkout_settings().skip else [f for f in files if f.state == PLACEHOLDER]
    code = 1 if missing else 0
    if as_json:
        emit_json({"files": [f.to_json() for f in files],
                   "placeholders": [{"path": f.path, "why": f.why} for f in missing]})
        raise typer.Exit(code)
    if not files:
        print("no theta-tracked checkpoints in the index", file=sys.stderr)
        return
    names = {f.path: printable(f.path) for f in files}
    width = max(len(n) for n in names.values())
    for f in files:
        if f.error:
            print(f"{names[f.path]:<{width}}  metadata unreadable: {f.error}")
            continue
        blobs = f"blobs {f.blobs_local}/{f.blobs} local" + (f" ({f.blobs_missing} missing)" if f.blobs_missing
                                                             else "")
        staged = ""
        if f.staged.new_file:
            staged = "  staged: new file"
        elif f.staged.any:
            parts = [f"{n} {what}" for n, what in ((f.staged.modified, "modified"), (f.staged.added, "added"),
                                                   (f.staged.removed, "removed")) if n]
            staged = "  staged: " + ", ".join(parts) + " group(s)"
        print(f"{names[f.path]:<{width}}  {f.state:<12} {f.format or '?':<11} {f.groups:>6} groups "
              f"{human_bytes(f.size):>10}  {blobs}{staged}")
    for f in missing:
        print(f"{names[f.path]} is a placeholder ({f.why})", file=sys.stderr)
    if any(f.state == PLACEHOLDER for f in files):
        print("placeholders hold the metadata text, not the checkpoint: `git theta pull` (or "
              "`git theta checkout PATH`) writes the checkpoints", file=sys.stderr)
    if any(f.blobs_missing for f in files):
        print("missing blobs are fetched by `git theta pull`, or by checking the file out", file=sys.stderr)
    raise typer.Exit(code)


def _explain(files: list) -> None:
    """Each placeholder's ``why``: what the checkout that left it recorded (theta.commands.filter.handoff), when
    the file still holds that placeholder; else UNRECORDED."""
    from theta.commands.filter import handoff
    from theta.git import repo as gitutil
    from theta.storage.tracked import PLACEHOLDER

    placeholders = [f for f in files if f.state == PLACEHOLDER]
    if not placeholders:
        return
    top = gitutil.toplevel()
    left, hash_name = handoff.left(top), gitutil.object_format(top)
    for f in placeholders:
        f.why = UNRECORDED
        rec = left.get(f.path)
        if rec is not None:
            try:
                text = (top / f.path).read_bytes()
            except OSError:
                continue
            if gitutil.blob_id(text, hash_name) == rec["oid"]:
                f.why = rec["why"]
