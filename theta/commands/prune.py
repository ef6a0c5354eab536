"""`git theta prune`: delete the blobs theta keeps that nothing local needs (:mod:`theta.storage.prune` decides
which; docs/guide/repository-care.md says what each kind of local state keeps)."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from theta.git import repo as gitutil
from theta.settings import parse_bool
from zipslice.clistyle import JSON_OPTION, emit_json
from zipslice.progress import Bar, human_bytes


def prune(dry_run: bool = typer.Option(False, "--dry-run", "-d", help="Only report what would be deleted."),
          verify_remote: Optional[bool] = typer.Option(
              None, "--verify-remote/--no-verify-remote", "-c",
              help="Delete only blobs downloaded back from the remote with their sha256 (default: "
                   "lfs.pruneverifyremotealways)."),
          remote: Optional[str] = typer.Option(None, "--remote", help="Remote to verify against (default: "
                                               "lfs.pruneremotetocheck, else the default remote)."),
          verbose: bool = typer.Option(False, "--verbose", "-v", help="List each blob deleted."),
          as_json: bool = JSON_OPTION,
          ) -> None:
    """Delete the blobs theta keeps that nothing local needs (local refs, stash, indexes, worktrees,
    unpushed and reflog commits keep theirs). Reports the bytes freed."""
    from theta.storage.prune import prune as run_prune  # (numpy: `git theta -h` and hooks stay light)

    if verify_remote is None:
        verify_remote = parse_bool(gitutil.config_get("lfs.pruneverifyremotealways") or "false",
                                   "lfs.pruneverifyremotealways")
    with Bar("verifying on the remote") as bar:
        report = run_prune(dry_run=dry_run, verify_remote=verify_remote, remote=remote,
                           on_verified=bar.advance)
    if as_json:
        emit_json({"dry_run": report.dry_run, "needed": report.needed, "kept": report.kept,
               "candidates": len(report.candidates), "deleted": [r.oid for r in report.deleted],
               "freed": report.freed, "unverified": [r.oid for r in report.unverified],
               "recent": [r.oid for r in report.recent], "relinked": [r.oid for r in report.relinked],
               "remote": report.remote})
        return
    if verbose:
        for r in report.deleted:
            print(f"{'would delete' if dry_run else 'deleted'} {r.oid} ({human_bytes(r.size)})")
    verb = "would free" if dry_run else "freed"
    print(f"prune: {report.kept} blob(s) kept by theta, {report.needed} needed locally; "
          f"{'would delete' if dry_run else 'deleted'} {len(report.deleted)}, {verb} {human_bytes(report.freed)}"
          f" ({report.freed} bytes)")
    if report.unverified:
        print(f"prune: kept {len(report.unverified)} blob(s) the remote {report.remote!r} did not give back",
              file=sys.stderr)
    if report.relinked:
        print(f"prune: {'would make' if dry_run else 'made'} {len(report.relinked)} duplicated blob(s) one "
              "file again (their two names had become two copies)")
    if report.recent:
        print(f"prune: kept {len(report.recent)} blob(s) used while pruning", file=sys.stderr)
