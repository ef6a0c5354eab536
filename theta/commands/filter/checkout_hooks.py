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

from theta import settings
from theta.commands.filter import handoff
from theta.commands.filter.materialize import HEADER, MAX_PLACEHOLDER_BYTES, Outcome, Placeholder, materialize, report
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
    return out


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
