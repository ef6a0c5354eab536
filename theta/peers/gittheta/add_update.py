"""`git theta add PATH --update-type T --update-data FILE` in Git-Theta's documented form: the work tree holds
the ORIGINAL checkpoint; the file is first rewritten to previous-with-update (theta.peers.gittheta.update_files), then
added like any side-loaded update (the current form, which the clean filter checks and stores exactly)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from theta.git import repo as gitutil
from theta.peers.gittheta.files import GitThetaFile, is_git_theta
from theta.peers.gittheta.update_files import PARTS, UpdateData, WorktreeForm, apply_to_worktree
from theta.storage.metadata import is_metadata, loads
from theta.storage.store import LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates.rebuild import reconstruct


def committed_values(rel: str, top: Path) -> Callable[[str], "np.ndarray | None"]:
    """``value(group)`` of ``rel``'s version in the index, else HEAD, in theta's or Git-Theta's format
    (None for a group that version lacks, or no version at all). Blobs are fetched on first use."""
    store = LfsStore.for_repo(top)
    for spec in (f":{rel}", f"HEAD:{rel}"):
        data = gitutil.read_blob(spec, top)
        if data is None:
            continue
        if is_metadata(data):
            meta = loads(data)
            fetch_missing(top, meta.blob_refs(), store=store)
            return lambda g: reconstruct(meta.groups[g], store, file=rel) if g in meta.groups else None
        if is_git_theta(data):
            gtf = GitThetaFile(data, rel, top, store, label=spec)
            gtf.fetch()
            names = set(gtf.names())
            return lambda g: gtf.value(g) if g in names else None
        break
    return lambda g: None


def prepare(paths: list[str], update_type: str, update_data: Path, cwd: str | os.PathLike = ".") -> list[str]:
    """Rewrite each tracked checkpoint among ``paths`` that holds the original values; returns messages."""
    if update_type not in PARTS:
        return []
    top = gitutil.toplevel(cwd)
    notes = []
    for p in paths:
        full = Path(cwd, p).resolve()
        if not full.is_file():
            continue  # a pathspec or an option: git add handles it
        rel = os.path.relpath(full, top).replace(os.sep, "/")
        if gitutil.check_attr("filter", [rel], top).get(rel) != "theta":
            continue
        data = UpdateData.open(update_data, update_type)
        try:
            form: WorktreeForm = apply_to_worktree(full, data, committed_values(rel, top))
        finally:
            data.close()
        if form.original:
            notes.append(f"{rel}: applied the {update_type} update of {update_data} to {len(form.original)} "
                         f"group(s) holding the previous values; the file now holds what is committed")
    return notes
