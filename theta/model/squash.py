"""Squash: make every group of a checkpoint's metadata self-contained (one dense step each)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from theta.updates import get
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

    One group in memory at a time; the rebuilt values are bit for bit what a checkout writes, so the
    working tree stays clean."""
    groups, rewritten, before = {}, 0, store.written_bytes
    for name, group in meta.groups.items():
        first = group.steps[0] if group.steps else None
        if len(group.steps) == 1 and not get(first.type).incremental:
            groups[name] = group
            continue
        value = reconstruct(group, store, file=file)
        step = store_dense(value, store)
        groups[name] = replace(group, steps=[step])
        rewritten += 1
        del value
    return replace(meta, groups=groups), SquashReport(file or "", len(meta.groups), rewritten,
                                                      store.written_bytes - before)
