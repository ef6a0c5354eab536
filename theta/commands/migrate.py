"""`git theta migrate [PATH...]`: rewrite the staged version of every Git-Theta-tracked checkpoint into theta's
format, staged like `git theta squash` (the work tree is unchanged: it already holds those values).

All files are converted before anything is staged: a file, group or update type theta cannot read fails the
whole command naming them, with nothing staged. Earlier commits keep Git-Theta's format; theta reads them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer

from theta.base.errors import ThetaError
from theta.git import repo as gitutil
from zipslice.clistyle import QUIET_OPTION, note, say, set_quiet


@dataclass
class Migrated:
    path: str
    groups: int


def git_theta_paths(top: Path) -> list[str]:
    """Tracked files (filter=theta) whose staged version is Git-Theta metadata."""
    from theta.peers.gittheta.files import is_git_theta

    files = [p for p in gitutil.run(["ls-files", "-z"], top).decode("utf-8").split("\0") if p]
    tracked = [p for p, v in gitutil.check_attr("filter", files, top).items() if v == "theta"]
    return [p for p in tracked if is_git_theta(gitutil.read_blob(f":{p}", top))]


def migrate(paths: list[str], cwd: str | os.PathLike = ".") -> list[Migrated]:
    """Convert and stage; returns what was migrated (empty when nothing is in Git-Theta's format)."""
    from theta.peers.gittheta.files import GitThetaFile, is_git_theta, to_theta_metadata
    from theta.storage.metadata import dumps
    from theta.storage.store import LfsStore

    top = gitutil.toplevel(cwd)
    if paths:
        rels = [os.path.relpath(Path(cwd, p).resolve(), top).replace(os.sep, "/") for p in paths]
        for rel in rels:
            if not is_git_theta(gitutil.read_blob(f":{rel}", top)):
                raise ThetaError(f"{rel}: the staged version is not Git-Theta metadata; nothing to migrate")
    else:
        rels = git_theta_paths(top)
    store = LfsStore.for_repo(top)
    spool = gitutil.theta_dir(top)
    converted = []
    for rel in rels:  # everything converted first: a failure stages nothing
        gtf = GitThetaFile(gitutil.read_blob(f":{rel}", top), rel, top, store, label=f"{rel} (staged)")
        gtf.fetch()
        meta = to_theta_metadata(gtf, spool)
        converted.append((rel, dumps(meta).encode("utf-8"), len(meta.groups)))
    done = []
    for rel, text, groups in converted:
        oid = gitutil.run(["hash-object", "-w", "--no-filters", "--stdin"], top, input=text).decode().strip()
        mode = gitutil.run_text(["ls-files", "-s", "--", rel], top).split()[0]
        gitutil.run(["update-index", "--cacheinfo", f"{mode},{oid},{rel}"], top)
        done.append(Migrated(rel, groups))
    return done


# -- the verb -------------------------------------------------------------------------------------

def migrate_command(paths: Optional[List[str]] = typer.Argument(None, metavar="PATH",
                                                        help="Files to migrate (default: every Git-Theta-format "
                                                             "tracked file)."),
            quiet: bool = QUIET_OPTION) -> None:
    """Rewrite the staged version of Git-Theta-format checkpoints in theta's format (then `git commit`)."""
    set_quiet(quiet)
    done = migrate(paths or [])
    if not done:
        note("nothing to migrate: no staged file is in Git-Theta's format")
        return
    head = gitutil.run_text(["rev-parse", "--short", "HEAD"], check=False) or "HEAD"
    for m in done:
        say(f"migrated {m.path}: {m.groups} groups now in theta's format; the result is staged")
    note(f"history up to {head} stays in Git-Theta's format (theta reads it); commit to finish")
