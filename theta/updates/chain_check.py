"""Check that a group's chain rebuilds, frame by frame: what `git theta fsck` asks of every chain.

The checks are those of :func:`theta.updates.rebuild.reconstruct` with ``verify=True`` followed by a comparison with the
group's name: every step's blob decodes and applies, every step's value hashes to the name its step records, and
the last value to the group's name (each in its name's algorithm, theta.base.valuehash). Memory: a few frames, not the
value: a chain that streams in one pass (:class:`theta.updates.stream.GroupSource`) is read once, each step's value
hashed as its step is applied; one read by position (rows moved, a change of dtype) is read once per step, each
prefix of the chain checked against its last step's name. Only an empty group, or a chain that streams neither way
(:func:`theta.updates.stream.source` is None: :func:`reconstruct` names what is wrong with it), is rebuilt whole.
"""
from __future__ import annotations

from dataclasses import replace

from zipslice import dtypes

from theta.base import valuehash
from theta.base.errors import ChainError
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore
from theta.updates import bounds, content_hash, step_layout, stream
from theta.updates.rebuild import reconstruct

def check_chain(group: GroupMeta, store: LfsStore, file: str | None = None) -> None:
    """Raise (ChainError, CodecError, BlobCorruptError, MetadataError: located) unless ``group``'s chain rebuilds
    the values its steps and the group name."""
    src = stream.source(group, store, file)
    if src is None:
        value = reconstruct(group, store, file=file, verify=True)
        if group.hash and content_hash(value, like=group.hash) != group.hash:
            raise _differs(group, file)
        return
    if isinstance(src, stream.GroupSource):
        _one_pass(src, group, file)
        return
    for i in range(len(group.steps) - 1):  # by position: each prefix of the chain is a chain of its own
        dtype, shape = step_layout(group.steps[i], group)
        prefix = replace(group, dtype=dtype, shape=tuple(shape), steps=group.steps[:i + 1], hash=group.steps[i].hash)
        _drain(stream.source(prefix, store, file) or _whole(prefix, store, file))
    if group.steps[-1].hash != group.hash:
        _drain(stream.source(replace(group, hash=group.steps[-1].hash), store, file))
    _drain(src)  # the group's own name, checked at the end of the pass


def _one_pass(src: stream.GroupSource, group: GroupMeta, file: str | None) -> None:
    steps = group.steps
    # the last step's value is the group's: its name is checked by the source itself when the names agree
    hashers = {i: valuehash.like(s.hash) for i, s in enumerate(steps) if i < len(steps) - 1 or s.hash != group.hash}

    def on_step(i, values) -> None:
        h = hashers.get(i)
        if h is not None:
            h.update(dtypes.le_bytes(values))

    for _ in src.chunks(stream.BLOCK, on_step=on_step):
        pass
    for i, h in hashers.items():
        if h.hexdigest() != steps[i].hash:
            raise ChainError(f"{bounds.where(file, group.name, i, steps[i].blob.oid)}: step {steps[i].type!r} "
                             f"rebuilt a value whose hash differs from the recorded {steps[i].hash}",
                             file=file, group=group.name, oid=steps[i].blob.oid)


def _whole(group: GroupMeta, store: LfsStore, file: str | None):
    return reconstruct(group, store, file=file, verify=True)


def _drain(src) -> None:
    if src is None or not hasattr(src, "chunks"):
        return  # rebuilt whole (and checked) by _whole
    for _ in src.chunks(stream.BLOCK):
        pass


def _differs(group: GroupMeta, file: str | None) -> ChainError:
    return ChainError(f"{bounds.where(file, group.name, len(group.steps) - 1, group.steps[-1].blob.oid)}: the "
                      f"rebuilt value's hash differs from the group's recorded hash", file=file, group=group.name,
                      oid=group.steps[-1].blob.oid)
