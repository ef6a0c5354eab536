"""Three-way merge of checkpoint metadata, planned from metadata first, then executed group by group.

:func:`plan_merge` decides every group from the three metadata texts alone (no tensor is read): unchanged or
changed on one side -> that side's steps; added/deleted on one side -> git's rules; changed on both sides ->
``plan.pending`` (needs a strategy); shape/dtype changes and delete/modify -> ``plan.conflicts``.
:func:`execute` then merges the pending groups one at a time into new dense blobs (memory: a few frames of each
input, read block by block -- :mod:`theta.updates.stream` -- and of the result, encoded and hashed block by block
as it is computed: :mod:`theta.updates.dense_stream`). Choosing strategies (configuration, the interactive menu) is the merge driver's job.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import numpy as np

from zipslice import dtypes

from theta.base import valuehash
from theta.base.errors import MergeConflict
from theta.merges import get as get_strategy
from theta.storage.metadata import Alias, CheckpointMeta, GroupMeta
from theta.storage.store import LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates import dense_stream, stream
from theta.updates.rebuild import reconstruct
from theta.updates.steps import dense_group
from theta.updates.stream import side_by_side

_CHECK_CHUNK = 1 << 20


def _group_key(g: GroupMeta | None):
    return None if g is None else (g.dtype, tuple(g.shape), g.hash, g.is_parameter, g.requires_grad)


def value_equal(x: GroupMeta, y: GroupMeta, store: LfsStore, file: str, fetch: Callable[[list], None]) -> bool:
    """Whether two groups whose names are in different forms (a sha256 one, a BLAKE3 one: theta.base.valuehash) hold
    the same value: the BLAKE3-named value is read block by block (its blobs fetched first, with ``fetch``) and
    hashed in the other name's algorithm. Groups of another dtype or shape never do."""
    if (x.dtype, tuple(x.shape)) != (y.dtype, tuple(y.shape)):
        return False
    if valuehash.is_blake3(x.hash) == valuehash.is_blake3(y.hash):
        return x.hash == y.hash
    new, old = (x, y) if valuehash.is_blake3(x.hash) else (y, x)
    fetch([st.blob for st in new.steps])
    h = valuehash.like(old.hash)
    src = stream.source(new, store, file) or reconstruct(new, store, file=file)
    for _, block in stream.blocks(src, _CHECK_CHUNK):
        h.update(dtypes.le_bytes(block))
    return h.hexdigest() == old.hash


def _three_way_by_value(o: GroupMeta | None, a: GroupMeta | None, b: GroupMeta | None,
                        same: Callable[[GroupMeta, GroupMeta], bool]) -> tuple[str, Any]:
    """:func:`three_way` of groups that compare unequal by name, where two names in different forms may still
    stand for one value (``same`` reads and decides; called only for such pairs, at most three times)."""
    def equal(x, y) -> bool:
        if x is None or y is None:
            return False
        kx, ky = _group_key(x), _group_key(y)
        return (kx[:2] + kx[3:] == ky[:2] + ky[3:] and valuehash.is_blake3(x.hash) != valuehash.is_blake3(y.hash)
                and same(x, y))
    if equal(a, b):
        return "same", a
    if equal(o, a):
        return "theirs", b
    if equal(o, b):
        return "ours", a
    return "both", None


def _alias_key(a: Alias | None):
    return None if a is None else (a.of, a.is_parameter, a.requires_grad)


def _json_key(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def three_way(o: Any, a: Any, b: Any, key: Callable[[Any], Any]) -> tuple[str, Any]:
    """("same"|"ours"|"theirs", value) when at most one side changed, ("both", None) otherwise."""
    ka, kb, ko = key(a), key(b), key(o)
    if ka == kb:
        return "same", a
    if ka == ko:
        return "theirs", b
    if kb == ko:
        return "ours", a
    return "both", None


def _describe(g: GroupMeta) -> str:
    return f"{g.dtype}{list(g.shape)}"


_CONTAINERS = ("dict", "odict", "list", "tuple")


def _kind(node: Any) -> str | None:
    if isinstance(node, dict):
        for k in _CONTAINERS:
            if k in node:
                return k
    return None


def merge_structure(o: Any, a: Any, b: Any, values: str | None, conflicts: list[str], path: str = "") -> Any:
    """Three-way merge of zipslice structure trees, node by node.

    Containers with the same keys on both sides merge child by child; a non-tensor value (an epoch counter, a
    name) changed differently on both sides is a conflict unless ``values`` is "ours" or "theirs".
    """
    side, value = three_way(o, a, b, _json_key)
    if side != "both":
        return value
    where = path or "(root)"
    ka, kb = _kind(a), _kind(b)
    if ka is not None and ka == kb:
        if ka in ("dict", "odict"):
            keys_a, keys_b = [k for k, _ in a[ka]], [k for k, _ in b[kb]]
            if keys_a == keys_b:
                o_children = dict((_json_key(k), v) for k, v in o[ka]) if _kind(o) == ka else {}
                merged = {ka: [[k, merge_structure(o_children.get(_json_key(k)), va, vb, values, conflicts,
                                                   f"{path}/{k}" if path else str(k))]
                               for (k, va), (_, vb) in zip(a[ka], b[kb])]}
                if "metadata" in a or "metadata" in b:
                    merged["metadata"] = merge_structure(o.get("metadata") if _kind(o) == ka else None,
                                                         a.get("metadata"), b.get("metadata"), values, conflicts,
                                                         f"{where}._metadata")
                return merged
        elif len(a[ka]) == len(b[kb]):
            o_items = o[ka] if _kind(o) == ka and len(o[ka]) == len(a[ka]) else [None] * len(a[ka])
            return {ka: [merge_structure(oi, ai, bi, values, conflicts, f"{path}/{i}" if path else str(i))
                         for i, (oi, ai, bi) in enumerate(zip(o_items, a[ka], b[kb]))]}
    is_value = all(isinstance(n, dict) and _kind(n) is None and "tensor" not in n for n in (a, b))
    if is_value and values in ("ours", "theirs"):
        return a if values == "ours" else b
    if is_value:
        conflicts.append(f"(value) {where}: changed on both sides ({_json_key(a)} vs {_json_key(b)}); choose with "
                         "`git config theta.merge.values ours|theirs` or GIT_THETA_MERGE_VALUES")
    else:
        conflicts.append(f"(file) {where}: the checkpoint structure changed on both sides")
    return None


@dataclass
class Pending:
    """A group changed on both sides, mergeable in principle (same dtype and shape)."""

    name: str
    ours: GroupMeta
    theirs: GroupMeta
    ancestor: GroupMeta | None   # None when there is no usable ancestor (added on both sides, or reshaped)
    strategy: str | None = None
    params: dict = field(default_factory=dict)
    source: str = ""


@dataclass
class MergePlan:
    """The decision for every group of one checkpoint, made from metadata alone by :func:`plan_merge`.

    Attributes:
        kept: groups taken unchanged from one side (no data read).
        pending: groups changed on both sides that need a strategy; set each one's ``strategy`` and
            ``params`` before :func:`execute`.
        aliases: tied names of the result.
        conflicts: one line per group (or file-level change) that cannot be merged automatically;
            call :func:`execute` only when it is empty (the merge driver stops in conflict otherwise).
        header: format, file metadata, structure, LSH parameters and order of the result.
        counts: how many groups were unchanged, or taken from ours or theirs.
    """

    path: str
    ours: CheckpointMeta
    kept: dict[str, GroupMeta] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    aliases: dict[str, Alias] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"unchanged": 0, "ours": 0, "theirs": 0})


def plan_merge(ancestor: CheckpointMeta | None, ours: CheckpointMeta, theirs: CheckpointMeta,
               path: str, values: str | None = None,
               same_value: Callable[[GroupMeta, GroupMeta], bool] | None = None) -> MergePlan:
    """Decide every group from the metadata alone; groups needing math go to ``plan.pending``.

    ``values``: what to do with a non-tensor value changed differently on both sides (None: conflict).
    ``same_value``: asked (e.g. :func:`value_equal`) only for a group changed on both sides by name where two of
    its names are in different forms (sha256 and BLAKE3), so that a value that went back to one named by sha256,
    or two sides naming one value differently, are seen as the same value; without it such names differ.
    """
    plan = MergePlan(path=path, ours=ours)
    og = ancestor.groups if ancestor else {}
    for name in sorted(set(og) | set(ours.groups) | set(theirs.groups)):
        o, a, b = og.get(name), ours.groups.get(name), theirs.groups.get(name)
        side, value = three_way(o, a, b, _group_key)
        if side == "both" and same_value is not None:
            side, value = _three_way_by_value(o, a, b, same_value)
        if side != "both":
            if value is not None:
                plan.kept[name] = value
            plan.counts["unchanged" if side == "same" else side] += 1
        elif a is None or b is None:
            deleted, modified = ("ours", "theirs") if a is None else ("theirs", "ours")
            plan.conflicts.append(f"{name}: deleted on {deleted} but modified on {modified}")
        elif (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            plan.conflicts.append(f"{name}: ours is {_describe(a)} but theirs is {_describe(b)} "
                                  f"(a shape or dtype change is never merged automatically)")
        else:
            usable = o if o is not None and (o.dtype, tuple(o.shape)) == (a.dtype, tuple(a.shape)) else None
            plan.pending.append(Pending(name, a, b, usable))

    oa = ancestor.aliases if ancestor else {}
    for name in sorted(set(oa) | set(ours.aliases) | set(theirs.aliases)):
        side, value = three_way(oa.get(name), ours.aliases.get(name), theirs.aliases.get(name), _alias_key)
        if side == "both":
            plan.conflicts.append(f"{name}: tied (alias) differently on each side")
        elif value is not None:
            plan.aliases[name] = value

    what = {"format": "checkpoint format", "metadata": "file-level metadata"}
    for name in ("format", "metadata"):
        o = getattr(ancestor, name) if ancestor else None
        side, value = three_way(o, getattr(ours, name), getattr(theirs, name), _json_key)
        if side == "both":
            plan.conflicts.append(f"(file) the {what[name]} changed on both sides")
        plan.header[name] = value
    plan.header["structure"] = merge_structure(ancestor.structure if ancestor else None, ours.structure,
                                               theirs.structure, values, plan.conflicts)
    plan.header["lsh"] = ours.lsh

    names = set(plan.kept) | {p.name for p in plan.pending} | set(plan.aliases)
    o_order = ancestor.order if ancestor else None
    side, order = three_way(o_order, ours.order, theirs.order, _json_key)
    if side == "both":
        if plan.header.get("structure") is None:
            # flat formats: our order, then their new names in their order
            order = [n for n in ours.order if n in names] + [n for n in theirs.order if n not in ours.order]
        else:
            order = None
    conflicts_so_far = bool(plan.conflicts)  # a group conflict already explains a mismatching order
    if not conflicts_so_far and (order is None or len(order) != len(set(order)) or set(order) != names):
        plan.conflicts.append("(file) groups were added/removed on both sides in ways that cannot be combined")
    plan.header["order"] = order
    return plan


def fetch_for(plan: MergePlan, store: LfsStore, repo_dir: str | os.PathLike) -> None:
    """Download, in one git-lfs run, the blobs of every group whose value the merge will read."""
    refs = []
    for p in plan.pending:
        strategy = get_strategy(p.strategy)
        if strategy.picks is not None:
            continue
        for g in (p.ours, p.theirs, p.ancestor if strategy.needs_ancestor else None):
            if g is not None:
                refs.extend(s.blob for s in g.steps)
    if store.missing(refs):
        fetch_missing(repo_dir, refs, store=store)


def new_non_finite(merged: np.ndarray, inputs: list) -> int:
    """How many elements of ``merged`` are NaN/inf where every input (an array or a source of blocks) is
    finite, chunk by chunk; the inputs are read only when ``merged`` has a non-finite element."""
    if merged.dtype.kind not in "fc" and not dtypes.from_numpy(merged.dtype).is_float:
        return 0
    flat = merged.reshape(-1)
    if all(_finite(flat[s:s + _CHECK_CHUNK]).all() for s in range(0, flat.size, _CHECK_CHUNK)):
        return 0
    count = 0
    for sl, *ins in side_by_side(inputs, _CHECK_CHUNK):
        bad = ~_finite(flat[sl])
        if not bad.any():
            continue
        for a in ins:
            bad &= _finite(a)
        count += int(np.count_nonzero(bad))
    return count


def new_non_finite_block(merged: np.ndarray, inputs: list[np.ndarray]) -> int:
    """How many elements of a block of a merge's result are NaN/inf where every input's block is finite."""
    if merged.dtype.kind not in "fc" and not dtypes.from_numpy(merged.dtype).is_float:
        return 0
    bad = ~_finite(merged)
    if not bad.any():
        return 0
    for a in inputs:
        bad &= _finite(a)
    return int(np.count_nonzero(bad))


def _merge_streamed(p: "Pending", strategy, a, b, o, store: LfsStore) -> tuple[GroupMeta | None, int]:
    """The merged group, its result computed, encoded and hashed block by block (never whole), and how many
    of its elements came out non-finite from finite inputs; when some did, nothing is stored (None)."""
    bad = [0]

    def blocks():
        for sl, merged, inputs in strategy.merge_blocks(p.name, a, b, o, **p.params):
            bad[0] += new_non_finite_block(merged, inputs)
            del inputs
            yield sl, merged

    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, per group
        staged = dense_stream.stage_dense(a.dtype, tuple(a.shape), blocks(), store)
    if bad[0]:
        staged.discard()
        return None, bad[0]
    return dense_stream.publish_group(p.ours, staged, store), 0


def _finite(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind not in "fc":  # ml_dtypes (bfloat16, float8): widen a chunk to test it
        a = a.astype(np.float32)
    return np.isfinite(a)


def execute(plan: MergePlan, store: LfsStore, log: TextIO | None = None) -> CheckpointMeta:
    """Merge the pending groups one at a time (memory: a few frames -- inputs read block by block, the result of a
    built-in strategy encoded block by block as it is computed; a third-party strategy without ``streams = True``
    gets its inputs rebuilt whole and returns its result whole: up to 4 groups, its documented contract) and
    build the metadata.

    A strategy that turns finite inputs into NaN or inf (an overflowing alpha, an extreme t) makes that
    group a conflict: MergeConflict naming every such group, raised once all groups were tried; nothing
    is written for the file."""
    groups = dict(plan.kept)
    poisoned: list[str] = []
    for i, p in enumerate(plan.pending, 1):
        strategy = get_strategy(p.strategy)
        if strategy.picks is not None:
            groups[p.name] = {"ours": p.ours, "theirs": p.theirs, "ancestor": p.ancestor}[strategy.picks]
        else:
            cache: dict = {}
            if getattr(strategy, "streams", False):
                # read block by block (theta.updates.stream: in one pass, or by position when rows moved or
                # the dtype changed): memory is the result and a few frames, not three groups; only an empty
                # group or a malformed chain (reconstruct reports it, located) is rebuilt whole
                def value(g):
                    return stream.source(g, store, plan.path) or reconstruct(g, store, file=plan.path)
            else:
                # ours and theirs usually derive from the ancestor (update chains): rebuilding it first lets
                # reconstruct start their chains from it; the cache lives for this group only
                def value(g):
                    return reconstruct(g, store, cache, file=plan.path)
            o = value(p.ancestor) if strategy.needs_ancestor else None
            a = value(p.ours)
            b = value(p.theirs)
            if getattr(strategy, "merge_blocks", None) is not None and getattr(strategy, "streams", False):
                merged_group, bad = _merge_streamed(p, strategy, a, b, o, store)
            else:
                with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, per group
                    merged = strategy.merge(p.name, a, b, o, **p.params)
                bad = new_non_finite(merged, [x for x in (a, b, o) if x is not None])
                merged_group = None if bad else dense_group(p.ours, merged, store)
                del merged
            del a, b, o, cache
            if bad:
                params = ", ".join(f"{k}={v:g}" for k, v in sorted(p.params.items()))
                poisoned.append(f"{p.name}: strategy {p.strategy!r}" + (f" ({params})" if params else "")
                                + f" turned finite values into {bad} NaN/inf (from {p.source}); choose other "
                                  "parameters or another strategy")
                continue
            groups[p.name] = merged_group
            del value
        if log is not None:
            params = ", ".join(f"{k}={v:g}" for k, v in sorted(p.params.items()))
            log.write(f"theta: {plan.path}: [{i}/{len(plan.pending)}] {p.name}: {p.strategy}"
                      + (f" ({params})" if params else "") + f"  [{p.source}]\n")
    if poisoned:
        raise MergeConflict(plan.path, poisoned)
    h = plan.header
    meta = CheckpointMeta(format=h["format"], order=list(h["order"]), groups=groups, structure=h["structure"],
                          aliases=dict(plan.aliases), metadata=dict(h["metadata"] or {}), lsh=dict(h["lsh"] or {}))
    meta.validate()
    return meta


