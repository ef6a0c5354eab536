"""Placeholders between the filter that hands them to git and the process that writes their checkpoints.

The filter answers git with a placeholder for a large checkpoint (:mod:`theta.commands.filter.materialize`); the
checkpoint is written once git has finished. Who writes it decides what the user sees when that fails:

- after ``checkout``, ``switch``, ``restore``, ``clone`` and ``worktree add``, git runs the post-checkout hook
  and makes its exit status the command's (githooks(5)): theta's hook writes the checkpoints, so a checkout
  that cannot produce the model fails;
- after ``reset --hard`` (and ``stash``, which runs it), the post-index-change hook does (git ignores its exit
  status: one line per file on stderr);
- after every other command (merge, pull, cherry-pick, rebase, stash pop...), the filter itself, when git
  closes its stdin at exit (git ignores the filter's exit status: one line per file on stderr).

Both sides meet in files under ``<git-dir>/theta/`` (this work tree's own git directory):

- ``handed-<pid>``: the placeholders filter process <pid> handed to git, one JSON line each (path, blob id,
  when). A hook *takes* every ledger (renames it, then reads it) and writes their checkpoints; the filter
  writes those of its ledger only when no hook took it.
- ``placeholders.json``: ``{path: {"oid", "why"}}``, every placeholder a materialization left, or is writing
  now (recorded before the first byte, so a process killed meanwhile leaves the record). `git theta status`
  says why from it, and the next checkout, switch, restore or reset --hard writes what it lists: running the
  same git command again completes the work.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from theta.git import repo as gitutil

LEDGER_PREFIX = "handed-"
LEFT = "placeholders.json"
MAX_RECORD_BYTES = 16 << 20  # a ledger or the left record larger than this is not ours to read


def state_dir(root: str | os.PathLike) -> Path:
    """``<git-dir>/theta`` of the work tree at ``root`` (a linked worktree's own), created."""
    d = gitutil.git_path("theta", root)
    d.mkdir(parents=True, exist_ok=True)
    return d


class Ledger:
    """The placeholders one filter process handed to git (``handed-<pid>``), written as they are handed."""

    def __init__(self, root: str | os.PathLike):
        self.root = root
        self.path: Path | None = None

    def add(self, path: str, oid: str, issued_ns: int) -> None:
        if self.path is None:
            self.path = state_dir(self.root) / f"{LEDGER_PREFIX}{os.getpid()}"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"path": path, "oid": oid, "issued_ns": issued_ns}) + "\n")

    def taken(self) -> bool:
        """Whether a hook took this ledger (its placeholders are that hook's to write and report)."""
        return self.path is not None and not self.path.exists()

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None


def take(root: str | os.PathLike) -> list[dict]:
    """Every ledger of this work tree, taken: the records ({"path", "oid", "issued_ns"}), last one per path."""
    d = state_dir(root)
    records: dict[str, dict] = {}
    for ledger in sorted(d.glob(LEDGER_PREFIX + "*")):
        taken = ledger.with_name(f"taken-{ledger.name}-{os.getpid()}")
        try:
            os.rename(ledger, taken)
        except OSError:
            continue  # another hook took it first
        try:
            if taken.stat().st_size <= MAX_RECORD_BYTES:
                for line in taken.read_text(encoding="utf-8", errors="replace").splitlines():
                    rec = _record(line)
                    if rec is not None:
                        records[rec["path"]] = rec
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                taken.unlink()
    return list(records.values())


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # a line cut short by a kill
    if not (isinstance(rec, dict) and isinstance(rec.get("path"), str) and isinstance(rec.get("oid"), str)):
        return None
    if not isinstance(rec.get("issued_ns"), int):
        rec["issued_ns"] = None
    return rec


# -- what was left --------------------------------------------------------------------------------------------
def record_path(root: str | os.PathLike) -> Path:
    """Where the record of what is left lives (``<git-dir>/theta/placeholders.json``)."""
    return gitutil.git_path("theta", root) / LEFT


def left(root: str | os.PathLike) -> dict[str, dict]:
    """``{path: {"oid", "why"}}``: the placeholders recorded as left (see the module docstring)."""
    p = record_path(root)
    try:
        if p.stat().st_size > MAX_RECORD_BYTES:
            return {}
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)
            and isinstance(v.get("oid"), str) and isinstance(v.get("why"), str)}


def note(root: str | os.PathLike, changes: dict[str, "tuple[str, str] | None"]) -> None:
    """Record ``path -> (oid, why)`` as left, or forget ``path -> None`` (its checkpoint was written); the file
    goes once nothing is left. Replaced in one step (a reader sees the old record or the new one)."""
    if not changes:
        return
    record = left(root)
    for path, what in changes.items():
        if what is None:
            record.pop(path, None)
        else:
            record[path] = {"oid": what[0], "why": what[1]}
    d = state_dir(root)
    target = d / LEFT
    try:
        if not record:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            return
        tmp = d / f".{LEFT}.{os.getpid()}"
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only or full repository: the placeholders are still found by scanning (git theta status)
