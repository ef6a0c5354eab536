"""`git theta` repository-care commands: status, fsck, prune, untrack, uninstall.

What each one checks, keeps or deletes is documented in docs/guide/repository-care.md; the logic lives in
:mod:`theta.commands.status`, :mod:`theta.model.fsck`, :mod:`theta.storage.prune`, :mod:`theta.commands.track`
and :mod:`theta.commands.install`. Listings take ``--json`` (one JSON document on stdout).
"""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from zipslice.clistyle import JSON_OPTION, emit_json, printable
from zipslice.progress import Bar, human_bytes


def problem_lines(problems) -> list[str]:
    """One line per bad blob (naming every file, group and version that needs it) and per broken chain or
    unreadable metadata text."""
    from collections import OrderedDict

    merged: "OrderedDict[tuple, list]" = OrderedDict()
    for p in problems:
        key = (p.kind, p.oid, p.detail, p.repaired) if p.oid else (p.kind, p.file, p.group, p.detail, p.repaired, id(p))
        merged.setdefault(key, []).append(p)
    lines = []
    for ps in merged.values():
        p = ps[0]
        state = "repaired " if p.repaired else ""
        if p.oid:
            users: "OrderedDict[tuple, list[str]]" = OrderedDict()
            for q in ps:
                users.setdefault((q.file, q.group), []).append(q.where)
            needed = "; ".join(f"{f} group {g!r} ({', '.join(dict.fromkeys(w))})" for (f, g), w in users.items())
            lines.append(printable(f"{state}{p.kind}: blob {p.oid} ({human_bytes(p.size)}): {p.detail}; "
                                  f"needed by {needed}"))
        else:
            group = f" group {p.group!r}" if p.group else ""
            lines.append(printable(f"{state}{p.kind}: {p.file} ({p.where}){group}: {p.detail}"))
    return lines


def register(app: typer.Typer) -> None:
    """Add the care commands to the `git theta` app."""

    @app.command("status")
    def status(as_json: bool = JSON_OPTION) -> None:
        """Each theta-tracked checkpoint: materialized or placeholder, blobs local/missing, size, format,
        and the staged change against HEAD in groups."""
        from theta.commands.status import PLACEHOLDER, repo_status

        files = repo_status()
        if as_json:
            emit_json({"files": [f.to_json() for f in files]})
            return
        if not files:
            print("no theta-tracked checkpoints in the index", file=sys.stderr)
            return
        names = {f.path: printable(f.path) for f in files}
        width = max(len(n) for n in names.values())
        for f in files:
            if f.error:
                print(f"{names[f.path]:<{width}}  metadata unreadable: {f.error}")
                continue
            blobs = f"blobs {f.blobs_local}/{f.blobs} local" + (f" ({f.blobs_missing} missing)" if f.blobs_missing
                                                                 else "")
            staged = ""
            if f.staged.new_file:
                staged = "  staged: new file"
            elif f.staged.any:
                parts = [f"{n} {what}" for n, what in ((f.staged.modified, "modified"), (f.staged.added, "added"),
                                                       (f.staged.removed, "removed")) if n]
                staged = "  staged: " + ", ".join(parts) + " group(s)"
            print(f"{names[f.path]:<{width}}  {f.state:<12} {f.format or '?':<11} {f.groups:>6} groups "
                  f"{human_bytes(f.size):>10}  {blobs}{staged}")
        if any(f.state == PLACEHOLDER for f in files):
            print("placeholders hold the metadata text, not the checkpoint: `git theta pull` (or "
                  "`git theta checkout PATH`) writes the checkpoints", file=sys.stderr)
        if any(f.blobs_missing for f in files):
            print("missing blobs are fetched by `git theta pull`, or by checking the file out", file=sys.stderr)

    @app.command("fsck")
    def fsck(revs: Optional[List[str]] = typer.Argument(None, help="Revisions to check (default: local refs, "
                                                        "index, stash, unpushed history)."),
             pointers: bool = typer.Option(False, "--pointers", help="Check the metadata texts only."),
             repair: bool = typer.Option(False, "--repair", help="Refetch missing and corrupt blobs from the "
                                         "remote (corrupt ones are moved to <lfs>/theta-quarantine first)."),
             remote: Optional[str] = typer.Option(None, "--remote", help="Remote to repair from."),
             as_json: bool = JSON_OPTION,
             ) -> None:
        """Check that every blob the metadata needs is present with its sha256, and that every group's chain
        rebuilds to its recorded hash. Exit status 1 on any problem left."""
        from theta.model.fsck import fsck as run_fsck

        with Bar("fsck") as bar:
            report = run_fsck(revs=list(revs or []), pointers_only=pointers, repair=repair, remote=remote,
                              on_bytes=bar.advance)
        if as_json:
            emit_json(report.to_json())
        else:
            for line in problem_lines(report.problems):
                print(line)
            what = "metadata text(s)" if pointers else (f"metadata text(s), {report.groups} group chain(s), "
                                                       f"{report.blobs} blob(s) ({human_bytes(report.bytes)})")
            left = len(problem_lines([p for p in report.problems if not p.repaired]))
            verdict = "OK" if report.ok else f"{left} problem(s)"
            extra = f", {report.repaired} blob(s) refetched" if report.repaired else ""
            print(f"checked {report.files} {what}: {verdict}{extra}", file=sys.stderr)
            if not report.ok and not repair and any(p.kind in ("missing", "corrupt") for p in report.problems):
                print("`git theta fsck --repair` refetches missing and corrupt blobs from the remote", file=sys.stderr)
        raise typer.Exit(0 if report.ok else 1)

    @app.command("prune")
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
        from theta.git import repo as gitutil
        from theta.settings import parse_bool
        from theta.storage.prune import prune as run_prune

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

    @app.command("untrack")
    def untrack(patterns: List[str] = typer.Argument(..., help="Patterns to stop tracking, as listed by "
                                                     "`git theta track`.")) -> None:
        """Remove theta's filter/diff/merge from patterns in .gitattributes (committed history is unchanged)."""
        from theta.commands.track import untrack as do_untrack

        changed = set(do_untrack(patterns))
        for p in patterns:
            print(f"{'Untracking' if p in changed else 'Not tracked by theta:'} {p}")

    @app.command("uninstall")
    def uninstall(local: bool = typer.Option(False, "--local", help="This repository's configuration only."),
                  ) -> None:
        """Remove what `git theta install` added: config keys, the launcher, this repository's theta hooks
        (restoring the hooks theta had chained). Blobs and .gitattributes are left as they are."""
        from theta.commands.install import uninstall as do_uninstall

        report = do_uninstall(local=local)
        for line in report.changed:
            print(line)
        for line in report.warnings:
            print(f"warning: {line}", file=sys.stderr)
        if not report.changed:
            print("git-theta was not installed here", file=sys.stderr)
