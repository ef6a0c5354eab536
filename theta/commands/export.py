"""`git theta export REV:PATH OUT`: write any committed version of a checkpoint without touching the work tree."""
from __future__ import annotations

import os
import sys

from theta.git import repo as gitutil
from theta.errors import ThetaError


def export(spec: str, out: str | os.PathLike, fmt: str | None = None, cwd=None, progress: bool | None = None) -> str:
    """Rebuild ``spec`` (``REV:PATH``, or ``:PATH`` for the index) into ``out``; returns the format written."""
    from theta.storage.transfer import fetch_missing
    from theta.storage.metadata import is_metadata, loads
    from theta.smudge import smudge_checkpoint
    from theta.storage.store import LfsStore

    if ":" not in spec:
        raise ThetaError(f"{spec!r}: give REV:PATH (e.g. HEAD~1:model.pt)")
    data = gitutil.read_blob(spec, cwd)
    if data is None:
        raise ThetaError(f"{spec}: no such file in git")
    if not is_metadata(data):
        raise ThetaError(f"{spec} is not a theta-tracked checkpoint (no theta metadata)")
    meta = loads(data, file=spec)
    store = LfsStore.for_repo(cwd or ".")
    fetch_missing(cwd or ".", meta.blob_refs(), store=store)
    smudge_checkpoint(meta, store, os.fspath(out), fmt=fmt,
                      progress=sys.stderr.isatty() if progress is None else progress)
    _default_mode(out)
    return fmt or meta.format


def _default_mode(path) -> None:
    """The writers publish through mkstemp (mode 0600); give the exported file the usual 0666 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
