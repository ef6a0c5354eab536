"""`git theta` commands of the merge/diff area: merge-driver, diff-driver, diff, merge-manual, merge-strategies."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from theta.git import repo as gitutil
from zipslice.clistyle import JSON_OPTION, QUIET_OPTION, note, set_quiet


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


def register(app: typer.Typer) -> None:
    """Add this area's commands to the `git theta` app."""

    @app.command("merge-driver", hidden=True)
    def merge_driver(ancestor: str = typer.Argument(..., metavar="%O"), ours: str = typer.Argument(..., metavar="%A"),
                     theirs: str = typer.Argument(..., metavar="%B"),
                     marker_size: str = typer.Argument("7", metavar="%L"),
                     path: str = typer.Argument("checkpoint", metavar="%P")) -> None:
        """git's merge driver: `git-theta merge-driver %O %A %B %L %P` (result written over %A)."""
        from theta.commands.merge_driver import main

        raise typer.Exit(main(ancestor, ours, theirs, marker_size, path))

    @app.command("diff-driver", hidden=True,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def diff_driver(ctx: typer.Context) -> None:
        """git's external diff: path old-file old-hex old-mode new-file new-hex new-mode."""
        from theta.commands.diff import driver_main

        raise typer.Exit(driver_main(list(ctx.args)))

    @app.command("diff-textconv", hidden=True)
    def diff_textconv(file: str = typer.Argument(..., metavar="FILE")) -> None:
        """git textconv (diff.theta.textconv): one line per group, for `git log -p` without --ext-diff."""
        from theta.commands.diff import textconv_main

        raise typer.Exit(textconv_main(file))

    @app.command("diff", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
    def diff(args: Optional[List[str]] = typer.Argument(None, metavar="[REV [REV]] [-- PATH...]",
                                                        help="Revisions, then paths (after `--` if ambiguous)."),
             estimate: bool = typer.Option(False, "--estimate",
                                           help="Estimate distances from LSH signatures; read no tensor data."),
             stat: bool = typer.Option(False, "--stat", help="One summary line per checkpoint."),
             color: Optional[bool] = typer.Option(None, "--color/--no-color", help="Force colour on or off."),
             as_json: bool = JSON_OPTION,
             ) -> None:
        """Per-group model diff (added/removed/modified, norms of the change) without writing any checkpoint.

        No REV: index vs working tree; one REV: REV vs working tree; two: REV vs REV.
        """
        from theta.commands.diff import diff_command

        revs, paths = _split_revs_paths(list(args or []))
        diff_command(revs, paths, estimate=estimate, stat=stat, color=color, as_json=as_json)

    @app.command("merge-manual")
    def merge_manual(path: str = typer.Argument(..., metavar="PATH",
                                                help="A checkpoint left in conflict by `git merge`."),
                     to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                                      help="Write torch, safetensors or hdf5 instead."),
                     quiet: bool = QUIET_OPTION) -> None:
        """Write the ours/theirs/ancestor versions of a conflicted checkpoint beside it to merge by hand.

        Merge them with any tool, write the result to PATH, then `git add PATH` and commit.
        """
        from theta.base.errors import ThetaError
        from theta.commands.export import export

        set_quiet(quiet)
        p = Path(path)
        stem, suffix = (p.name[:-len("".join(p.suffixes))], "".join(p.suffixes)) if p.suffixes else (p.name, "")
        repo_path = gitutil.run_text(["ls-files", "--full-name", "--", path], check=False).splitlines()
        if not repo_path:
            raise ThetaError(f"{path}: not in the index (is it a conflicted, theta-tracked checkpoint?)")
        written = []
        for stage, role in ((2, "ours"), (3, "theirs"), (1, "ancestor")):
            out = p.with_name(f"{stem}.{role}{suffix}")
            if not gitutil.object_exists(f":{stage}:{repo_path[0]}"):
                if stage == 1:
                    continue  # added on both sides: no ancestor
                raise ThetaError(f"{path}: no stage {stage} ({role}) in the index; is the file in conflict?")
            export(f":{stage}:{repo_path[0]}", out, fmt=to)
            written.append(str(out))
        for w in written:
            print(w)
        note(f"Merge them into {path}, then `git add {path}` and commit.")

    @app.command("merge-resolve")
    def merge_resolve(path: str = typer.Argument(..., metavar="PATH",
                                                 help="A checkpoint left in conflict by `git merge`."),
                      strategy: str = typer.Option(..., "--strategy", "-s", metavar="NAME",
                                                   help="A merge strategy: average, ties, ours, ... "
                                                        "(`git theta merge-strategies` lists them)."),
                      param: List[str] = typer.Option([], "--param", "-p", metavar="NAME=VALUE",
                                                      help="A strategy parameter, e.g. density=0.3."),
                      quiet: bool = QUIET_OPTION) -> None:
        """Resolve a conflicted checkpoint with a merge strategy: write the result and stage it (then commit)."""
        from theta.base.errors import ThetaError
        from theta.commands.merge_driver import resolve_conflicted
        from theta.base.errors import MergeConflict

        set_quiet(quiet)
        params = {}
        for kv in param:
            key, sep, value = kv.partition("=")
            if not sep or not key.strip():
                raise typer.BadParameter(f"expected NAME=VALUE, got {kv!r}", param_hint="'--param'")
            params[key.strip().replace("-", "_")] = value
        try:
            resolve_conflicted(path, strategy, params)
        except MergeConflict as e:
            raise ThetaError(str(e)) from None
        note(f"Resolved {path} with {strategy}; staged. Commit to conclude the merge.")

    @app.command("merge-strategies")
    def merge_strategies(as_json: bool = JSON_OPTION) -> None:
        """List the installed merge strategies and their parameters."""
        from theta.merges import get, names
        from zipslice.clistyle import emit_json

        found = [get(name) for name in names()]
        if as_json:
            emit_json({"strategies": [{"name": s.name, "summary": s.summary, "parameters": dict(s.defaults),
                                       "needs_ancestor": s.needs_ancestor} for s in found]})
            return
        for name, s in zip(names(), found):
            params = ", ".join(f"{k}={v:g}" for k, v in s.defaults.items())
            print(f"{name:<16} {s.summary}" + (f"  [{params}]" if params else ""))
