"""`git theta status`: each theta-tracked checkpoint of the index, materialized or placeholder, its blobs, size,
format and the staged change against HEAD (the facts come from :mod:`theta.storage.tracked`)."""
from __future__ import annotations

import sys

from zipslice.clistyle import JSON_OPTION, emit_json, printable
from zipslice.progress import human_bytes


def status(as_json: bool = JSON_OPTION) -> None:
    """Each theta-tracked checkpoint: materialized or placeholder, blobs local/missing, size, format,
    and the staged change against HEAD in groups."""
    from theta.storage.tracked import PLACEHOLDER, repo_status  # (numpy: `git theta -h` and hooks stay light)

    files = repo_status()
    if as_json:
        emit_json({"files": [f.to_json() for f in files]})
        return
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
    if any(f.state == PLACEHOLDER for f in files):
        print("placeholders hold the metadata text, not the checkpoint: `git theta pull` (or "
              "`git theta checkout PATH`) writes the checkpoints", file=sys.stderr)
    if any(f.blobs_missing for f in files):
        print("missing blobs are fetched by `git theta pull`, or by checking the file out", file=sys.stderr)
