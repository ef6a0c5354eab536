"""Squash: make every group of a checkpoint's metadata self-contained (one dense step each)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from theta.updates import dense_stream, get, stream
from theta.updates.rebuild import reconstruct
from theta.updates.steps import store_dense


@dataclass
class SquashReport:
    path: str
    groups: int
    rewritten: int          # groups whose chain had more than one step, or an incremental first step
    new_blob_bytes: int


def squash_meta(meta, store, file: str | None = None):
    """A copy of ``meta`` whose every group is one dense step holding the value its chain rebuilds.

    Each chain is read block by block and its value encoded as it comes (:mod:`theta.updates.dense_stream`):
    a few frames in memory, never the value; the rebuilt values are bit for bit what a checkout writes, so the
    working tree stays clean."""
    groups, rewritten, before = {}, 0, store.written_bytes
    for name, group in meta.groups.items():
        first = group.steps[0] if group.steps else None
        if len(group.steps) == 1 and not get(first.type).incremental:
            groups[name] = group
            continue
        groups[name] = replace(group, steps=[_dense_step(group, store, file)])
        rewritten += 1
    return replace(meta, groups=groups), SquashReport(file or "", len(meta.groups), rewritten,
                                                      store.written_bytes - before)


def _dense_step(group, store, file: str | None):
    """One dense step holding ``group``'s value, read block by block from its chain (its name checked at the end
    of the pass, before the blob is stored); an empty group or a chain that does not stream is rebuilt whole."""
    src = stream.source(group, store, file)
    if src is None:
        return store_dense(reconstruct(group, store, file=file), store)
    return dense_stream.publish_step(dense_stream.stage_dense(src.dtype, src.shape, src.chunks(stream.BLOCK), store),
                                     store)
