"""What theta's post-checkout and post-index-change hooks do: write the checkpoints left as placeholders.

Each takes the placeholders the filter handed to git in this command (its ledger) and those an earlier
command left (``placeholders.json``; see :mod:`theta.commands.filter.handoff`), keeps those the work tree still holds
(the file's bytes are that placeholder's), and writes their checkpoints (:func:`materialize`).

- post-checkout (checkout, switch, restore, clone, worktree add): exit status 1 when a checkpoint could not be
  written, which git makes the command's. During a rebase it does nothing: the rebase's filter writes the
  checkpoints of its last state when git ends (each pick would otherwise write an intermediate one).
- post-index-change: only after `git reset` (also run by `git stash`), with the work tree updated; git ignores
  its exit status, so the lines on stderr are what the user sees.

Either way, running the same command again (``git checkout X``, ``git switch X``, ``git restore PATH``,
``git reset --hard``) writes what an earlier run left: git leaves the placeholders alone (their stat data
matches the index), but the hook finds them in the record.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from theta import settings
from theta.base.errors import IndexBusyError, IndexUnsupportedError
from theta.commands.filter import handoff
from theta.commands.filter.materialize import HEADER, MAX_PLACEHOLDER_BYTES, Outcome, Placeholder, materialize, report
from theta.git import index as gitindex
from theta.git import repo as gitutil


def placeholders_to_write(root: Path) -> list[Placeholder]:
    """The placeholders of this command's ledgers and of the record that the work tree still holds; records of
    files that hold something else now are forgotten."""
    wanted = {r["path"]: r for r in handoff.take(root)}
    for path, rec in handoff.left(root).items():
        wanted.setdefault(path, {"path": path, "oid": rec["oid"], "issued_ns": None})
    hash_name = gitutil.object_format(root)
    out, stale = [], {}
    for path, rec in sorted(wanted.items()):
        text = _placeholder_text(root / path)
        if text is None or gitutil.blob_id(text, hash_name) != rec["oid"]:
            stale[path] = None
            continue
        out.append(Placeholder(path, text, rec["oid"], issued_ns=rec.get("issued_ns")))
    handoff.note(root, stale)
    _recheck(root, {path: wanted[path]["oid"] for path in stale}, hash_name)
    return out


def _recheck(root: Path, paths: dict[str, str], hash_name: str) -> None:
    """Have git check the content of files a killed writer put in place without recording them (killed between
    the swap and the index update: the index holds the placeholder's stat data, whose size git would take as a
    change without reading the file): their entries' size is recorded as 0, as git marks an entry whose content
    must be checked. Only entries still holding the placeholder's blob; any other file is left as it is."""
    updates = {}
    for path, oid in paths.items():
        try:
            st = os.stat(root / path)
        except OSError:
            continue
        fields = {k: getattr(st, k) for k in ("st_ctime", "st_ctime_ns", "st_mtime", "st_mtime_ns", "st_dev",
                                              "st_ino", "st_uid", "st_gid")}
        updates[path] = (oid, SimpleNamespace(**fields, st_size=0))
    if updates:
        try:
            gitindex.record_stat(gitutil.git_path("index", root), updates, hash_name)
        except (OSError, IndexBusyError, IndexUnsupportedError):
            pass  # git status then shows the file modified until `git add` finds its committed metadata


def _placeholder_text(path: Path) -> bytes | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_PLACEHOLDER_BYTES:
            return None
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    return text if text.startswith(HEADER) else None


def _write(root: Path) -> int:
    if settings.checkout_settings(root).skip:  # placeholders wanted (GIT_THETA_SKIP_SMUDGE, theta.skipSmudge)
        return 0
    todo = placeholders_to_write(root)
    outcome = materialize(root, todo) if todo else Outcome()
    report(outcome)
    return 130 if outcome.interrupted else 1 if outcome.left else 0


def post_checkout(cwd=None) -> int:
    """The post-checkout hook's work; its exit status (git makes it checkout's, switch's, clone's)."""
    if gitutil.invoking_subcommand() == "rebase":
        return 0
    return _write(gitutil.toplevel(cwd or os.getcwd()))


def post_index_change(worktree_updated: bool, cwd=None) -> int:
    """The post-index-change hook's work: after `git reset` updated the work tree (git ignores the status)."""
    if not worktree_updated or gitutil.invoking_subcommand() != "reset":
        return 0
    return _write(gitutil.toplevel(cwd or os.getcwd()))
