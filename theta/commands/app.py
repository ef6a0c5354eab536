"""`git theta ...`: the command line (typer), in the style every project command shares (:mod:`zipslice.clistyle`).

The entry point is :mod:`theta.commands.cli` (the console script): it starts git's filter process without
importing this module (typer and the command tree cost ~40 ms before git's handshake) and runs :func:`run`
for everything else.

User commands are listed by ``git theta -h``; the ones git runs (filter-process, clean, smudge, merge-driver,
diff-driver, diff-textconv, pre-push) are hidden. Every ThetaError (and a missing optional package, a
MissingDependencyError) becomes ``git theta: error: <message>`` on one line and exit status 1; a usage error names the flag and exits with status 2.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from zipslice import clistyle

from theta.base.errors import MissingDependencyError, ThetaError
from theta.commands import (add, checkout, diff, export, fsck, hooks, install, log, ls_files, merge, migrate, prune,
                            squash, status, track)
from theta.commands.entry import PROG, SCRIPT, filter_main, version  # noqa: F401 (PROG, SCRIPT: re-exported)
from theta.commands.filter import single_file

app = clistyle.make_app(
    SCRIPT, "Version ML checkpoints in git, parameter group by parameter group, with the groups stored in "
            "Git LFS. Run `git theta install` once, `git theta track '*.pt'` per repository, then use git as usual.",
    version=version)


_INTERNAL = ("filter-process", "clean", "smudge", "pre-push", "post-checkout", "post-index-change", "post-commit",
             "merge-driver", "diff-driver", "diff-textconv")


def help_cmd(ctx: typer.Context,
             command: Optional[List[str]] = typer.Argument(None, metavar="COMMAND",
                                                           help="The command to explain (default: all).")) -> None:
    """Show the help of a command: `git theta help diff` is `git theta diff -h`."""
    root = ctx.find_root()
    group = root.command
    if not command:
        print(root.get_help())
        return
    name = command[0]
    sub = group.get_command(root, name)
    if sub is None or sub.hidden and name not in _INTERNAL:
        raise typer.BadParameter(f"no command {name!r}; `git theta -h` lists them", param_hint="'COMMAND'")
    sub_ctx = sub.make_context(name, [], parent=root, resilient_parsing=True)
    print(sub_ctx.get_help())


def completion_cmd(shell: str = typer.Argument(..., metavar="SHELL", help="bash, zsh or fish.",
                                               **clistyle.one_of(clistyle.SHELLS, "shell"))) -> None:
    """Print the shell completion script (bash: for both `git theta` and `git-theta`); see the docs."""
    sys.stdout.write(clistyle.completion_script(SCRIPT, shell))


def filter_process() -> None:
    """git's long-running filter (filter.theta.process); see `git-theta-filter -h`."""
    raise typer.Exit(filter_main([]))


def clean(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file clean filter, as `git-theta-filter clean PATH`: checkpoint on stdin, metadata on stdout."""
    single_file.run("clean", path, sys.stdin.buffer, sys.stdout.buffer, os.getcwd())


def smudge(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file smudge filter, as `git-theta-filter smudge PATH`: metadata on stdin, checkpoint on stdout."""
    single_file.run("smudge", path, sys.stdin.buffer, sys.stdout.buffer, os.getcwd())


# -- the command tree -------------------------------------------------------------------------------
# Each verb family is one module of theta.commands; this table is the one list of what `git theta -h` shows, in
# its order. Hidden commands are the ones git runs.

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

VERBS = (
    ("install", install.install_command, {}),
    ("track", track.track_command, {}),
    ("add", add.add, {"context_settings": _PASS_THROUGH}),
    ("migrate", migrate.migrate_command, {}),
    ("ls-files", ls_files.ls_files, {}),
    ("export", export.export_command, {}),
    ("squash", squash.squash, {}),
    ("diff", diff.diff, {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": False}}),
    ("log", log.log, {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": False}}),
    ("merge-manual", merge.merge_manual, {}),
    ("merge-resolve", merge.merge_resolve, {}),
    ("merge-strategies", merge.merge_strategies, {}),
    ("status", status.status, {}),
    ("fsck", fsck.fsck, {}),
    ("prune", prune.prune, {}),
    ("untrack", track.untrack_command, {}),
    ("uninstall", install.uninstall_command, {}),
    ("checkout", checkout.checkout_cmd, {}),
    ("fetch", checkout.fetch_cmd, {}),
    ("pull", checkout.pull_cmd, {}),
    # last in `git theta -h`: about the command line itself
    ("help", help_cmd, {}),
    ("completion", completion_cmd, {}),
    # what git runs
    ("filter-process", filter_process, {"hidden": True}),
    ("clean", clean, {"hidden": True}),
    ("smudge", smudge, {"hidden": True}),
    ("post-commit", hooks.post_commit, {"hidden": True}),
    ("pre-push", hooks.pre_push, {"hidden": True}),
    ("post-checkout", hooks.post_checkout, {"hidden": True}),
    ("post-index-change", hooks.post_index_change, {"hidden": True}),
    ("merge-driver", merge.merge_driver, {"hidden": True}),
    ("diff-driver", diff.diff_driver, {"hidden": True, "context_settings": _PASS_THROUGH}),
    ("diff-textconv", diff.diff_textconv, {"hidden": True}),
)

_registered = False


def _register_areas() -> None:
    """Add every verb to the app, once."""
    global _registered
    if _registered:
        return
    _registered = True
    for name, function, options in VERBS:
        app.command(name, **options)(function)


def _app() -> typer.Typer:
    """The app with every area's commands (registered once)."""
    _register_areas()
    return app


def run(args: list[str]) -> int:
    """Run `git theta ARGS...` (every command but the filter process); returns the exit status."""
    return clistyle.run(_app(), PROG, args, user_errors=(ThetaError, MissingDependencyError), error_status=1,
                        complete_var="_GIT_THETA_COMPLETE")
