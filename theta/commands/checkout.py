"""`git theta checkout [PATH...]`, `git theta fetch [REV...]`, `git theta pull [PATH...]`.

What `git lfs checkout` / `git lfs fetch` / `git lfs pull` are to git-lfs:

- ``checkout`` replaces placeholders (work-tree files holding a checkpoint's metadata text, exactly as the
  index records it) with their checkpoints, streaming, in bounded memory, atomically, and records them in
  the index so `git status` stays clean (:mod:`theta.commands.filter.materialize`, the code the filter runs when a
  git command ends);
- ``fetch`` downloads, in one git-lfs run, every blob the theta-tracked checkpoints of the given revisions
  need (default HEAD), without touching the work tree;
- ``pull`` is fetch of HEAD, then checkout: the command for a clone made before theta was installed, or
  with GIT_THETA_SKIP_SMUDGE=1.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import typer

from theta.base.errors import ThetaError
from theta import settings
from theta.commands.filter.materialize import Outcome, find_placeholders, materialize, report
from theta.git import repo as gitutil
from zipslice.progress import human_bytes


@dataclass(frozen=True)
class FetchReport:
    files: int      # theta-tracked checkpoints in the revisions
    blobs: int      # distinct blobs they need
    fetched: int    # blobs downloaded now
    nbytes: int     # bytes of the blobs downloaded


def fetch(revs: list[str] | None = None, remote: str | None = None, cwd=None, progress: bool | None = None
          ) -> FetchReport:
    """Download the blobs of every theta-tracked checkpoint of ``revs`` (default HEAD) in one git-lfs run."""
    from theta.storage.tracked import iter_metadata  # (numpy: `git theta -h` and hooks stay light)
    from theta.storage.metadata import loads
    from theta.storage.store import LfsStore
    from theta.storage.transfer import fetch_missing

    root = gitutil.toplevel(cwd)
    refs = {}
    names = []
    for rev in revs or ["HEAD"]:
        if not gitutil.rev_exists(rev, root, kind="commit"):
            raise ThetaError(f"{rev!r} is not a commit")
        for name, data in iter_metadata(rev, root):
            names.append(name)
            for r in loads(data).blob_refs():
                refs[r.oid] = r
    store = LfsStore.for_repo(root)
    missing = store.missing(refs.values())
    show = settings.stderr_is_terminal() if progress is None else progress
    label = None
    if show and names:
        label = f"theta fetch {names[0]}" + (f" (+{len(set(names)) - 1} files)" if len(set(names)) > 1 else "")
    fetched = fetch_missing(root, missing, remote=remote, store=store, progress=label) if missing else 0
    return FetchReport(len(set(names)), len(refs), fetched, sum(r.size for r in missing))


def checkout(pathspecs: list[str] | None = None, cwd=None, remote: str | None = None, progress: bool | None = None):
    """Materialize the placeholders among the theta-tracked files matching ``pathspecs`` (default: all)."""

    root = gitutil.toplevel(cwd)
    found, other = find_placeholders(root, pathspecs, spec_cwd=cwd or os.getcwd())
    outcome = materialize(root, found, progress=progress, remote=remote) if found else Outcome()
    outcome.left.extend(other)
    return outcome


# -- the command line --------------------------------------------------------------------------------------
def _print_outcome(outcome, verb: str) -> int:
    for path in outcome.done:
        print(f"{verb} {path}")
    report(outcome)
    return 130 if outcome.interrupted else 1 if outcome.left else 0


# -- the verbs ------------------------------------------------------------------------------------

def checkout_cmd(paths: list[str] = typer.Argument(None, help="Files or pathspecs (default: every "
                                                              "theta-tracked file)."),
                 remote: str = typer.Option(None, "--remote", help="Remote to fetch missing blobs from "
                                                                   "(default: as git-lfs chooses).")) -> None:
    """Replace placeholders (files holding a checkpoint's metadata) with their checkpoints."""
    outcome = checkout(paths or None, remote=remote)
    if not outcome.done and not outcome.left:
        print("nothing to check out: every theta-tracked file holds its checkpoint", file=sys.stderr)
    raise typer.Exit(_print_outcome(outcome, "checked out"))


def fetch_cmd(revs: list[str] = typer.Argument(None, help="Revisions (default: HEAD)."),
              remote: str = typer.Option(None, "--remote", help="Remote whose LFS server to fetch from.")
              ) -> None:
    """Download the blobs of every theta-tracked checkpoint in REV (no work-tree change)."""
    r = fetch(revs or None, remote=remote)
    print(f"fetched {r.fetched} of {r.blobs} blob(s) ({human_bytes(r.nbytes)}) for {r.files} checkpoint(s)")


def pull_cmd(paths: list[str] = typer.Argument(None, help="Files or pathspecs (default: all)."),
             remote: str = typer.Option(None, "--remote", help="Remote whose LFS server to fetch from.")
             ) -> None:
    """Fetch the blobs of HEAD's checkpoints, then replace placeholders with checkpoints."""
    r = fetch(None, remote=remote)
    if r.fetched:
        print(f"fetched {r.fetched} blob(s) ({human_bytes(r.nbytes)})", file=sys.stderr)
    raise typer.Exit(_print_outcome(checkout(paths or None, remote=remote), "checked out"))
