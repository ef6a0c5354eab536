"""The theta metadata a tracked path holds in git: the index's version, else HEAD's.

What clean reuses and compares a work-tree file with (unchanged groups keep their names, sha256 ones
included: :mod:`theta.base.valuehash`), and what a diff of the work-tree file names its values like.
"""
from __future__ import annotations

import os

from theta.git import repo as gitutil
from theta.storage.metadata import is_metadata, loads


def committed_text(rel: str, top: str | os.PathLike) -> bytes | None:
    """The metadata text of ``rel`` (relative to the work tree's top) in the index, else in HEAD; None for a
    new file or one theta did not store."""
    for spec in (f":{rel}", f"HEAD:{rel}"):
        data = gitutil.read_blob(spec, top)
        if data is not None and is_metadata(data):
            return data
    return None


def committed_meta(rel: str, top: str | os.PathLike):
    """:func:`committed_text` read (``CheckpointMeta``), None also for an opaque file; a text that does not
    read raises ``MetadataError`` naming ``rel``."""
    data = committed_text(rel, top)
    if data is None:
        return None
    meta = loads(data, file=rel)
    return None if meta.is_opaque else meta
