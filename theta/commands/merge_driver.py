"""`git-theta merge-driver %O %A %B %L %P`: a three-way merge of checkpoint metadata, group by group.

Git hands us three metadata texts (ancestor, ours, theirs); the result is written over %A and git stores it
as the merged blob, then smudges it into the working tree. Per group:

- unchanged, or changed on one side only -> that version (its steps are reused: no data is read);
- added or deleted on one side -> follow that side (git's rules);
- changed on both sides -> the configured strategy (theta.settings.merge_rules) merges the values, one group at a
  time, into a new dense blob;
- shape/dtype differs between the sides, deleted on one side and modified on the other, or no strategy ->
  a conflict: reported by group name on stderr, exit status 1, %A left untouched (git keeps the index in
  conflict state as for any failed merge driver).

Every conflict is found from the metadata before any tensor is read, so a merge that cannot succeed stops at
once, and %A is replaced atomically only after every group is merged.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from theta import settings
from theta.base import scratch
from theta.base.errors import MergeConflict, MergeError, ThetaError
from theta.base.malloc import give_back_freed_memory
from theta.commands.merge_menu import MANUAL, ask
from theta.git import repo as gitutil
from theta.merges import applicable
from theta.merges import get as get_strategy
from theta.merges import names as strategy_names
from theta.merges.plan import MergePlan, Pending, _describe, execute, fetch_for, plan_merge, three_way, value_equal
from theta.model.smudge import smudge_checkpoint
from theta.settings.merge_rules import RULES_FILE, MergeConfig
from theta.storage.metadata import CheckpointMeta, dumps, is_metadata, loads
from theta.storage.store import LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates.bounds import check_output

NO_STRATEGY_HINT = (
    "no merge strategy is configured for groups changed on both sides. Choose one, e.g. "
    "`git config theta.merge.strategy average` (or ties, task-arithmetic, dare, slerp, ours, theirs), "
    "or GIT_THETA_MERGE_STRATEGY=ties for one command, or per-group rules in " + RULES_FILE
    + " (see docs/guide/merging.md) and run the merge again (git merge --abort first); or resolve this conflict "
    "now with `git theta merge-resolve PATH --strategy NAME`; or merge by hand: `git theta merge-manual PATH` "
    "writes ours/theirs/ancestor checkpoints")


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
                problem = check_params(strategy, p.params)
                if problem:
                    plan.conflicts.append(f"{p.name}: {problem} (from {p.source})")


def check_params(strategy, params: dict) -> str | None:
    """What is wrong with a strategy's parameters (any source), before any tensor is read; None if fine."""
    bad = [f"{k}={v!r}" for k, v in params.items() if not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        return f"merge parameter {', '.join(bad)} is not a finite number"
    validate = getattr(strategy, "params", None)
    if callable(validate):
        try:
            validate(params)
        except MergeError as e:
            return str(e)
    return None


def _applicable(p: Pending) -> list[str]:
    return applicable(p.ours.dtype, p.ancestor is not None)


def read_meta(path: str | os.PathLike, role: str, checkpoint: str, optional: bool = False) -> CheckpointMeta | None:
    data = Path(path).read_bytes()
    if optional and not data:
        return None  # git passes an empty ancestor when both sides added the file
    if not is_metadata(data):
        raise ThetaError(f"{checkpoint}: the {role} version is not theta metadata (was it committed without the "
                         f"theta filter? run `git theta install` and `git theta track`)")
    return loads(data, file=f"{checkpoint} ({role})")


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename; the temp file has no name until then (a kill leaves
    nothing behind, see theta.base.scratch)."""
    path = Path(path)
    fd, tmp = scratch.anonymous(path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n", closefd=False) as f:
            f.write(text)
        os.fchmod(fd, 0o644)
        scratch.publish(fd, tmp, path, replace=True)
        tmp = None
    finally:
        scratch.discard(fd, tmp)


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
    if any(m is not None and m.is_opaque for m in (ancestor, ours, theirs)):
        return merge_opaque(ancestor, ours, theirs, path, ours_file, err)

    limit = settings.max_checkout_bytes(repo_dir)
    for role, m in (("ancestor", ancestor), ("ours", ours), ("theirs", theirs)):
        if m is not None:  # metadata from a clone: refused before any value is rebuilt
            check_output(m, f"{path} ({role})", limit)
    config = config or MergeConfig.load(repo_dir)
    config.check_parameters({k for n in strategy_names() for k in get_strategy(n).defaults})
    store = LfsStore.for_repo(repo_dir)

    def fetch(refs: list) -> None:
        if store.missing(refs):
            fetch_missing(repo_dir, refs, store=store)

    plan = plan_merge(ancestor, ours, theirs, path, values=config.values,
                      same_value=lambda x, y: value_equal(x, y, store, path, fetch))
    if not plan.conflicts:
        choose_strategies(plan, config, stdin, err)
    if plan.conflicts:
        raise MergeConflict(path, plan.conflicts)
    fetch_for(plan, store, repo_dir)
    meta = execute(plan, store, log=err)
    write_atomically(ours_file, dumps(meta))
    c = plan.counts
    err.write(f"theta: merged {path}: {len(meta.groups)} groups ({c['unchanged']} unchanged, {c['ours']} from ours, "
              f"{c['theirs']} from theirs, {len(plan.pending)} merged by strategy)\n")
    return meta


def merge_opaque(ancestor: CheckpointMeta | None, ours: CheckpointMeta, theirs: CheckpointMeta, path: str,
                 ours_file: str, err: TextIO) -> CheckpointMeta:
    """A file stored as one opaque blob (on any side) merges like a binary file: the side that changed wins,
    a change on both sides is a conflict."""
    def key(m: CheckpointMeta | None):
        return None if m is None else (m.opaque if m.is_opaque else dumps(m))

    side, value = three_way(ancestor, ours, theirs, key)
    if side == "both":
        raise MergeConflict(path, ["(file) not a checkpoint (stored as one opaque blob) and changed on both "
                                   "sides; keep one with `git checkout --ours` or `--theirs`"])
    if side == "theirs":
        write_atomically(ours_file, dumps(value))
    err.write(f"theta: merged {path}: not a checkpoint, took {'ours' if side == 'same' else side}\n")
    return value


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
    repo = gitutil.toplevel(cwd)
    listed = gitutil.run_text(["ls-files", "--full-name", "--", str(path)], cwd).splitlines()
    if not listed:
        raise ThetaError(f"{path}: not in the index (is it a conflicted, theta-tracked checkpoint?)")
    rel = listed[0]
    stages = {n: gitutil.read_blob(f":{n}:{rel}", repo) for n in (1, 2, 3)}
    if stages[2] is None or stages[3] is None:
        raise ThetaError(f"{rel}: no ours/theirs stages in the index; is the file in conflict?")
    config = MergeConfig.load(repo)
    config.cli_strategy, config.interactive = strategy, False
    for key, value in (params or {}).items():
        try:
            config.cli_params[key] = float(value)
        except (TypeError, ValueError):
            raise ThetaError(f"--param {key}={value}: {value!r} is not a number") from None
    with tempfile.TemporaryDirectory(dir=gitutil.scratch_dir(repo)) as d:
        files = []
        for n, role in ((1, "ancestor"), (2, "ours"), (3, "theirs")):
            f = Path(d) / role
            f.write_bytes(stages[n] or b"")
            files.append(str(f))
        meta = merge_files(*files, rel, repo_dir=repo, config=config, err=err)
    # three jobs in one process, each bounded by frames: what one freed (and glibc keeps for this process,
    # theta.base.malloc) is returned before the next, so the merge's frames never add up with the rebuild's, nor
    # these with the clean filter `git add` starts beside this process
    give_back_freed_memory()
    # in the work tree's format: a path checked out as a view (theta-format, theta.checkoutFormat) stays one
    smudge_checkpoint(meta, LfsStore.for_repo(repo), repo / rel, fmt=settings.checkout_format(rel, repo))
    give_back_freed_memory()
    gitutil.run(["add", "--", rel], cwd=repo)
    return meta
