"""Storing steps and growing chains: the one place a step's blob is written.

Every writer of steps (clean's update policies, the merge, squash) goes through :func:`store_step`, so a
step's blob is always encoded the same way (codec parts, streamed into the store, never joined in memory).
"""
from __future__ import annotations

import numpy as np

from theta.base import lsh
from theta.base.errors import CheckpointError
from theta.storage import codec
from theta.storage.metadata import GroupMeta, Step
from theta.storage.store import LfsStore
from theta.updates import content_hash, fast_hash


def store_step(type_name: str, parts: dict[str, np.ndarray], params: dict, value_hash: str, store: LfsStore,
               level: int = codec.DEFAULT_LEVEL) -> Step:
    """Encode ``parts`` into one blob, stream it into the store, return the Step."""
    ref = store.put_stream(codec.iter_encode_parts(parts, level))
    if type_name == "dense":
        store.bind(ref.oid, value_hash)  # theta encoded this value itself: a checkout may trust its frames
    return Step(type=type_name, blob=ref, params=dict(params), hash=value_hash)


def store_encoded(type_name: str, chunks: list, params: dict, value_hash: str, store: LfsStore) -> Step:
    """Store a blob already encoded in memory."""
    ref = store.put_chunks(chunks)
    if type_name == "dense":
        store.bind(ref.oid, value_hash)
    return Step(type=type_name, blob=ref, params=dict(params), hash=value_hash)


def store_staged(type_name: str, staged, params: dict, value_hash: str, store: LfsStore) -> Step:
    """Publish a blob already encoded and staged (e.g. by the auto policy, which stages candidates to compare
    their sizes: :meth:`LfsStore.stage`)."""
    return Step(type=type_name, blob=staged.publish(store), params=dict(params), hash=value_hash)


def store_dense(value: np.ndarray, store: LfsStore, level: int = codec.DEFAULT_LEVEL,
                value_hash: str | None = None) -> Step:
    """A self-contained step holding ``value`` itself."""
    return store_step("dense", {"values": value}, {}, value_hash or content_hash(value), store, level)


def dense_group(like: GroupMeta, value: np.ndarray, store: LfsStore, level: int = codec.DEFAULT_LEVEL) -> GroupMeta:
    """A group with ``like``'s name and flags holding ``value`` as one dense step (with a fresh signature)."""
    step = store_dense(value, store, level)
    signature = lsh.signature(value) if lsh.hashable(like.dtype) else None
    return GroupMeta(name=like.name, dtype=like.dtype, shape=tuple(value.shape), hash=step.hash, steps=[step],
                     lsh=signature, is_parameter=like.is_parameter, requires_grad=like.requires_grad,
                     fast=fast_hash(value))


def chain(previous: GroupMeta | None, step: Step, incremental: bool) -> list[Step]:
    """The new chain: ``[step]`` when self-contained, else the previous steps + ``step``."""
    if not incremental:
        return [step]
    if previous is None:
        raise CheckpointError(f"an incremental {step.type} step needs a previous version")
    return [*previous.steps, step]


def chain_full(previous: GroupMeta | None, max_chain: int) -> bool:
    """True when appending one more step would exceed ``max_chain`` (store self-contained instead)."""
    return previous is not None and len(previous.steps) + 1 > max_chain
