"""`git theta diff` and the two diff programs git runs for theta-tracked paths (`diff-driver`: git's external
diff, `diff-textconv`: a text per group for `git log -p`); their work is in :mod:`theta.commands.diff_driver`,
imported when a command runs (it brings numpy: `git theta -h` and the hooks stay light without it)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from theta.git import repo as gitutil
from zipslice.clistyle import JSON_OPTION


def _split_revs_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """Like git: words before ``--`` that name commits are revisions, the rest are paths."""
    argv = sys.argv
    if "--" in argv:
        n_paths = len(argv) - argv.index("--") - 1
        if 0 <= n_paths <= len(args):
            return args[:len(args) - n_paths], args[len(args) - n_paths:]
    revs: list[str] = []
    for i, word in enumerate(args):
        ok = gitutil.rev_exists(word, kind="commit")
        if not ok or len(revs) == 2:
            return revs, args[i:]
        revs.append(word)
    return revs, []




def diff_driver(ctx: typer.Context) -> None:
    """git's external diff: path old-file old-hex old-mode new-file new-hex new-mode."""
    from theta.commands.diff_driver import driver_main

    raise typer.Exit(driver_main(list(ctx.args)))


def diff_textconv(file: str = typer.Argument(..., metavar="FILE")) -> None:
    """git textconv (diff.theta.textconv): one line per group, for `git log -p` without --ext-diff."""
    from theta.commands.diff_driver import textconv_main

    raise typer.Exit(textconv_main(file))


def diff(args: Optional[List[str]] = typer.Argument(None, metavar="[REV [REV]] [-- PATH...]",
                                                    help="Revisions, then paths (after `--` if ambiguous)."),
         estimate: bool = typer.Option(False, "--estimate",
                                       help="Estimate distances from LSH signatures; read no tensor data."),
         stat: bool = typer.Option(False, "--stat", help="One summary line per checkpoint."),
         color: Optional[bool] = typer.Option(None, "--color/--no-color", help="Force colour on or off."),
         as_json: bool = JSON_OPTION,
         html: Optional[Path] = typer.Option(None, "--html", metavar="OUT",
                                             help="Write a page with a bar per group (two REVs; what the merge did "
                                                  "to each group when the second is a merge commit)."),
         ) -> None:
    """Per-group model diff (added/removed/modified, norms of the change) without writing any checkpoint.

    No REV: index vs working tree; one REV: REV vs working tree; two: REV vs REV.
    """
    revs, paths = _split_revs_paths(list(args or []))
    if html is not None:
        from theta.commands.pictures import diff_html  # (numpy: `git theta -h` stays light)

        diff_html(revs, paths, html, exact=not estimate)
        return
    from theta.commands.diff_driver import diff_command

    diff_command(revs, paths, estimate=estimate, stat=stat, color=color, as_json=as_json)
