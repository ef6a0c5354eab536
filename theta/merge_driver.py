"""`git-theta merge-driver %O %A %B %L %P`: a three-way merge of checkpoint metadata, group by group.

Git hands us three metadata texts (ancestor, ours, theirs); the result is written over %A and git stores it
as the merged blob, then smudges it into the working tree. Per group:

- unchanged, or changed on one side only -> that version (its steps are reused: no data is read);
- added or deleted on one side -> follow that side (git's rules);
- changed on both sides -> the configured strategy (theta.merges.config) merges the values, one group at a
  time, into a new dense blob;
- shape/dtype differs between the sides, deleted on one side and modified on the other, or no strategy ->
  a conflict: reported by group name on stderr, exit status 1, %A left untouched (git keeps the index in
  conflict state as for any failed merge driver).

Every conflict is found from the metadata before any tensor is read, so a merge that cannot succeed stops at
once, and %A is replaced atomically only after every group is merged.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import numpy as np

from . import codec, lsh
from .errors import ThetaError
from .merges import MergeConflict, get as get_strategy, names as strategy_names
from .merges.config import RULES_FILE, MergeConfig
from .merges.menu import MANUAL, ask
from .metadata import Alias, CheckpointMeta, GroupMeta, Step, dumps, is_metadata, loads
from .store import LfsStore
from .updates import content_hash, get as get_update, reconstruct

NO_STRATEGY_HINT = (
    "no merge strategy is configured for groups changed on both sides. Choose one, e.g. "
    "`git config theta.merge.strategy average` (or ties, task-arithmetic, dare, slerp, ours, theirs), "
    "or GIT_THETA_MERGE_STRATEGY=ties for one command, or per-group rules in " + RULES_FILE
    + " (see README.md, 'Merging and diffing models with theta') and run the merge again (git merge --abort first); or resolve this conflict "
    "now with `git theta merge-resolve PATH --strategy NAME`; or merge by hand: `git theta merge-manual PATH` "
    "writes ours/theirs/ancestor checkpoints")


def _group_key(g: GroupMeta | None):
    return None if g is None else (g.dtype, tuple(g.shape), g.hash, g.is_parameter, g.requires_grad)


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
    path: str
    ours: CheckpointMeta
    kept: dict[str, GroupMeta] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    aliases: dict[str, Alias] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"unchanged": 0, "ours": 0, "theirs": 0})


def plan_merge(ancestor: CheckpointMeta | None, ours: CheckpointMeta, theirs: CheckpointMeta,
               path: str, values: str | None = None) -> MergePlan:
    """Decide every group from the metadata alone; groups needing math go to ``plan.pending``.

    ``values``: what to do with a non-tensor value changed differently on both sides (None: conflict).
    """
    plan = MergePlan(path=path, ours=ours)
    og = ancestor.groups if ancestor else {}
    for name in sorted(set(og) | set(ours.groups) | set(theirs.groups)):
        o, a, b = og.get(name), ours.groups.get(name), theirs.groups.get(name)
        side, value = three_way(o, a, b, _group_key)
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


def choose_strategies(plan: MergePlan, config: MergeConfig, stdin: TextIO | None, out: TextIO) -> None:
    """Fill in each pending group's strategy from the configuration, else the menu (stdin a terminal),
    else record a conflict. Strategies that cannot merge a group become conflicts too."""
    unset: list[Pending] = []
    for p in plan.pending:
        choice = config.choose(plan.path, p.name)
        p.strategy, p.params, p.source = choice.strategy, choice.params, choice.source
        if p.strategy is None:
            unset.append(p)
    if unset and config.interactive and stdin is not None and stdin.isatty():
        sticky: str | None = None
        for i, p in enumerate(unset):
            choices = [n for n in _applicable(p)]
            if sticky is not None and (sticky == MANUAL or sticky in choices):
                p.strategy, p.source = sticky, "interactive (all remaining)"
                continue
            answer = ask(plan.path, p.name, _describe(p.ours), choices, len(unset) - i - 1, stdin, out)
            p.strategy, p.source = answer.strategy, "interactive"
            if answer.for_all:
                sticky = answer.strategy
    unresolved = [p.name for p in plan.pending if p.strategy is None]
    if unresolved:
        shown = ", ".join(unresolved[:6]) + (f", ... ({len(unresolved)} in all)" if len(unresolved) > 6 else "")
        plan.conflicts.append(f"{shown}: changed on both sides; {NO_STRATEGY_HINT}")
    for p in plan.pending:
        if p.strategy is None:
            continue
        elif p.strategy == MANUAL:
            plan.conflicts.append(f"{p.name}: changed on both sides; left for a manual merge "
                                  f"(`git theta merge-manual {plan.path}`)")
        else:
            try:
                strategy = get_strategy(p.strategy)
            except ThetaError as e:
                plan.conflicts.append(f"{p.name}: {e} (from {p.source})")
                continue
            if not strategy.applies(p.ours.dtype, p.ancestor is not None):
                why = "has no common ancestor of the same shape" if strategy.needs_ancestor and p.ancestor is None \
                    else f"is {p.ours.dtype}"
                plan.conflicts.append(f"{p.name}: strategy {p.strategy!r} (from {p.source}) cannot merge it: "
                                      f"the group {why}; applicable: {', '.join(_applicable(p))}")
            else:
                known = strategy.defaults
                p.params = {k: v for k, v in p.params.items() if k in known}


def _applicable(p: Pending) -> list[str]:
    from .merges import applicable

    return applicable(p.ours.dtype, p.ancestor is not None)


def dense_group(like: GroupMeta, value: np.ndarray, store: LfsStore, level: int = codec.DEFAULT_LEVEL) -> GroupMeta:
    """A self-contained (dense) group holding ``value``, with ``like``'s name and flags."""
    encoded = get_update("dense").encode(value, None)
    ref = store.put_stream(codec.iter_encode_parts(encoded.parts, level))  # never the whole blob in memory
    digest = content_hash(value)
    signature = lsh.signature(value) if lsh.hashable(like.dtype) else None
    return GroupMeta(name=like.name, dtype=like.dtype, shape=tuple(value.shape), hash=digest,
                     steps=[Step(type="dense", blob=ref, params=dict(encoded.params), hash=digest)],
                     lsh=signature, is_parameter=like.is_parameter, requires_grad=like.requires_grad)


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
        from .lfs_transfer import fetch_missing

        fetch_missing(repo_dir, refs, store=store)


def execute(plan: MergePlan, store: LfsStore, log: TextIO | None = None) -> CheckpointMeta:
    """Merge the pending groups one at a time (memory: three inputs and one result) and build the metadata."""
    groups = dict(plan.kept)
    for i, p in enumerate(plan.pending, 1):
        strategy = get_strategy(p.strategy)
        if strategy.picks is not None:
            groups[p.name] = {"ours": p.ours, "theirs": p.theirs, "ancestor": p.ancestor}[strategy.picks]
        else:
            # ours and theirs usually derive from the ancestor (update chains): rebuilding it first lets
            # reconstruct start their chains from it; the cache lives for this group only
            cache: dict = {}
            o = reconstruct(p.ancestor, store, cache, file=plan.path) if strategy.needs_ancestor else None
            a = reconstruct(p.ours, store, cache, file=plan.path)
            b = reconstruct(p.theirs, store, cache, file=plan.path)
            merged = strategy.merge(p.name, a, b, o, **p.params)
            del a, b, o, cache
            groups[p.name] = dense_group(p.ours, merged, store)
            del merged
        if log is not None:
            params = ", ".join(f"{k}={v:g}" for k, v in sorted(p.params.items()))
            log.write(f"theta: {plan.path}: [{i}/{len(plan.pending)}] {p.name}: {p.strategy}"
                      + (f" ({params})" if params else "") + f"  [{p.source}]\n")
    h = plan.header
    meta = CheckpointMeta(format=h["format"], order=list(h["order"]), groups=groups, structure=h["structure"],
                          aliases=dict(plan.aliases), metadata=dict(h["metadata"] or {}), lsh=dict(h["lsh"] or {}))
    meta.validate()
    return meta


def read_meta(path: str | os.PathLike, role: str, checkpoint: str, optional: bool = False) -> CheckpointMeta | None:
    data = Path(path).read_bytes()
    if optional and not data:
        return None  # git passes an empty ancestor when both sides added the file
    if not is_metadata(data):
        raise ThetaError(f"{checkpoint}: the {role} version is not theta metadata (was it committed without the "
                         f"theta filter? run `git theta install` and `git theta track`)")
    return loads(data)


def write_atomically(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def merge_files(ancestor_file: str, ours_file: str, theirs_file: str, path: str,
                repo_dir: str | os.PathLike = ".", config: MergeConfig | None = None,
                stdin: TextIO | None = None, err: TextIO | None = None) -> CheckpointMeta:
    """The merge driver's work: read the three metadata files, merge, write the result over ``ours_file``.

    Raises MergeConflict (nothing written) when any group cannot be merged.
    """
    err = err or sys.stderr
    ancestor = read_meta(ancestor_file, "ancestor", path, optional=True)
    ours = read_meta(ours_file, "our", path)
    theirs = read_meta(theirs_file, "their", path)
    config = config or MergeConfig.load(repo_dir)
    config.check_parameters({k for n in strategy_names() for k in get_strategy(n).defaults})
    plan = plan_merge(ancestor, ours, theirs, path, values=config.values)
    if not plan.conflicts:
        choose_strategies(plan, config, stdin, err)
    if plan.conflicts:
        raise MergeConflict(path, plan.conflicts)
    store = LfsStore.for_repo(repo_dir)
    fetch_for(plan, store, repo_dir)
    meta = execute(plan, store, log=err)
    write_atomically(ours_file, dumps(meta))
    c = plan.counts
    err.write(f"theta: merged {path}: {len(meta.groups)} groups ({c['unchanged']} unchanged, {c['ours']} from ours, "
              f"{c['theirs']} from theirs, {len(plan.pending)} merged by strategy)\n")
    return meta


def main(ancestor_file: str, ours_file: str, theirs_file: str, marker_size: str, path: str) -> int:
    """Entry point for git: exit status 0 = merged, 1 = conflict (details on stderr)."""
    try:
        merge_files(ancestor_file, ours_file, theirs_file, path, repo_dir=".", stdin=sys.stdin, err=sys.stderr)
    except MergeConflict as e:
        sys.stderr.write(f"theta: CONFLICT in {e.path}: cannot merge automatically:\n")
        for problem in e.problems:
            sys.stderr.write(f"  {problem}\n")
        return 1
    except ThetaError as e:
        sys.stderr.write(f"theta: merge of {path} failed: {e}\n")
        return 1
    return 0


def resolve_conflicted(path: str, strategy: str, params: dict[str, float] | None = None,
                       cwd: str | os.PathLike = ".", err: TextIO | None = None) -> CheckpointMeta:
    """After a conflicted `git merge`: merge the index stages of ``path`` with ``strategy``, write the result to
    the working tree (atomically, through the normal smudge path) and stage it with `git add`.

    Groups changed on one side only follow git's rules as in the merge driver; ``strategy`` merges the groups
    changed on both sides. Shape/dtype and delete/modify conflicts still refuse (MergeConflict).
    """
    from . import gitutil
    from .smudge import smudge_checkpoint

    repo = gitutil.toplevel(cwd)
    listed = gitutil.run_text(["ls-files", "--full-name", "--", str(path)], cwd).splitlines()
    if not listed:
        raise ThetaError(f"{path}: not in the index (is it a conflicted, theta-tracked checkpoint?)")
    rel = listed[0]
    stages = {n: gitutil.read_blob(f":{n}:{rel}", repo) for n in (1, 2, 3)}
    if stages[2] is None or stages[3] is None:
        raise ThetaError(f"{rel}: no ours/theirs stages in the index; is the file in conflict?")
    config = MergeConfig.load(repo)
    config.env_strategy, config.interactive = strategy, False
    for key, value in (params or {}).items():
        try:
            config.env_params[key] = float(value)
        except (TypeError, ValueError):
            raise ThetaError(f"merge parameter {key}={value!r} is not a number") from None
    with tempfile.TemporaryDirectory(dir=gitutil.theta_dir(repo)) as d:
        files = []
        for n, role in ((1, "ancestor"), (2, "ours"), (3, "theirs")):
            f = Path(d) / role
            f.write_bytes(stages[n] or b"")
            files.append(str(f))
        meta = merge_files(*files, rel, repo_dir=repo, config=config, err=err)
    smudge_checkpoint(meta, LfsStore.for_repo(repo), repo / rel)
    gitutil.run(["add", "--", rel], cwd=repo)
    return meta
