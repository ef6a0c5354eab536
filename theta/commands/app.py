"""`git theta ...`: the command line (typer), in the style every project command shares (:mod:`zipslice.clistyle`).

The entry point is :mod:`theta.commands.cli` (the console script): it starts git's filter process without
importing this module (typer and the command tree cost ~40 ms before git's handshake) and runs :func:`run`
for everything else.

User commands are listed by ``git theta -h``; the ones git runs (filter-process, clean, smudge, merge-driver,
diff-driver, diff-textconv, pre-push) are hidden. Every ThetaError becomes ``git theta: error: <message>``
on one line and exit status 1; a usage error names the flag and exits with status 2.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from theta.base.errors import ThetaError
from theta.git import repo as gitutil
from zipslice import clistyle
from zipslice.clistyle import JSON_OPTION, QUIET_OPTION, emit_json, natural_key, note, say, set_quiet

from theta.commands.entry import PROG, SCRIPT, filter_main, version  # noqa: F401 (PROG, SCRIPT: re-exported)

app = clistyle.make_app(
    SCRIPT, "Version ML checkpoints in git, parameter group by parameter group, with the groups stored in "
            "Git LFS. Run `git theta install` once, `git theta track '*.pt'` per repository, then use git as usual.",
    version=version)


@app.command()
def install(local: bool = typer.Option(False, "--local", help="Configure this repository only."),
            quiet: bool = QUIET_OPTION) -> None:
    """Configure git for theta (global by default) and install this repository's hooks."""
    from theta.commands.install import install as do_install

    set_quiet(quiet)
    report = do_install(local=local)
    for line in report.changed:
        say(line)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if not report.changed:
        say("git-theta is already installed")


@app.command()
def track(patterns: Optional[List[str]] = typer.Argument(None, metavar="PATTERN",
                                                          help="gitattributes patterns, e.g. '*.pt'."),
          quiet: bool = QUIET_OPTION) -> None:
    """Mark paths as theta checkpoints in .gitattributes (filter=theta diff=theta merge=theta).

    Without a pattern: list the patterns tracked now (like `git lfs track`)."""
    from theta.commands.track import track as do_track, tracked_patterns

    set_quiet(quiet)
    if not patterns:
        listed = tracked_patterns()
        note("Listing tracked patterns" if listed else "no patterns are tracked by theta")
        for p in listed:
            print(f"    {p}")
        return
    changed = set(do_track(patterns))
    for p in patterns:
        say(f"{'Tracking' if p in changed else 'Already tracking'} {p}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def add(ctx: typer.Context,
        paths: List[str] = typer.Argument(..., metavar="PATH", help="Paths to add (and any `git add` options)."),
        update_type: Optional[str] = typer.Option(None, "--update-type", metavar="TYPE",
                                                  help="dense, sparse, low-rank, ia3, delta, rows or auto."),
        update_data: Optional[Path] = typer.Option(None, "--update-data", "--update-path", metavar="FILE",
                                                   help="A file holding the update (side-loaded; Git-Theta's "
                                                        "README spells it --update-path)."),
        option: List[str] = typer.Option([], "--option", "-o", metavar="KEY=VALUE",
                                         help="A clean option, passed to the filter as GIT_THETA_KEY."),
        checkpoint_type: Optional[str] = typer.Option(None, "--checkpoint-type", hidden=True,
                                                      help="Git-Theta's option: theta reads the format from the "
                                                           "file's bytes; use --format to change the committed one."),
        format: Optional[str] = typer.Option(None, "--format", metavar="FORMAT",
                                             help="Change the committed format to torch, safetensors or hdf5 "
                                                  "(whatever format the work-tree file has).",
                                             **clistyle.one_of(("torch", "safetensors", "hdf5"), "format")),
        source: Optional[Path] = typer.Option(None, "--from", metavar="SOURCE",
                                              help="Record the checkpoint at SOURCE (any format, e.g. a sharded "
                                                   "model.safetensors.index.json) as PATH's new version; PATH "
                                                   "is rewritten in the work tree."),
        ) -> None:
    """`git add` with clean options; they reach the filter as GIT_THETA_* environment variables.

    A file keeps the format it was committed in, whatever format it is checked out in (a view); `--format`
    is the one way to change it: the paths are cleaned again (`git add --renormalize`) and recorded as FORMAT.
    `--from SOURCE PATH` records another checkpoint (e.g. shards written by `git theta export`) as PATH, in
    PATH's committed format.
    """
    if source is not None:
        _add_from(source, paths, format, ctx.args, update_type or update_data or option)
        return
    env = dict(os.environ)
    if checkpoint_type:
        note(f"note: --checkpoint-type {checkpoint_type} is not needed: theta detects the checkpoint format "
             f"from the file (use --format to change the committed format)")
    if update_type:
        from theta import updates

        known = ["auto", *updates.names()]
        if update_type not in known:  # as Git-Theta's argparse choices: refused before git runs
            raise ThetaError(f"--update-type {update_type!r}: expected one of {', '.join(known)}")
    if update_type and update_data:
        # Git-Theta's workflow: the work tree may hold the ORIGINAL checkpoint; make it previous-with-update
        from theta.peers.gittheta.add_update import prepare

        for message in prepare([p for p in paths if not p.startswith("-")], update_type, update_data):
            note(message)
    if update_type:
        env["GIT_THETA_UPDATE_TYPE"] = update_type
    if update_data:
        env["GIT_THETA_UPDATE_DATA"] = str(update_data.resolve())
    for kv in option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {kv!r}", param_hint="'--option'")
        env["GIT_THETA_" + key.upper().replace("-", "_")] = value
    if format is not None:
        from theta.settings import FORMATS

        if format not in FORMATS:
            raise ThetaError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
        env["GIT_THETA_FORMAT"] = format
        # a tracked file whose stat matches the index would not be cleaned again by a plain `git add`
        status = gitutil.passthrough(["add", "--renormalize", *ctx.args, "--", *paths], env=env)
        if status != 0:
            raise typer.Exit(status)
    raise typer.Exit(gitutil.exec_or_passthrough(["add", *ctx.args, *paths], env=env))


def _add_from(source: Path, paths: List[str], fmt: Optional[str], git_args: List[str], other: object) -> None:
    from theta.commands.add_from import add_from

    if len(paths) != 1:
        raise typer.BadParameter(f"--from records one checkpoint as one PATH; got {len(paths)} paths",
                                 param_hint="'PATH'")
    if other:
        raise typer.BadParameter("--from takes no --update-type, --update-data or --option: SOURCE is cleaned "
                                 "as the file's next version with the repository's settings", param_hint="'--from'")
    done = add_from(source, paths[0], os.getcwd(), fmt, git_args)
    say(f"staged {done.path} ({done.format}) from {source}: {len(done.changed)} changed group"
        f"{'' if len(done.changed) == 1 else 's'}")


@app.command()
def migrate(paths: Optional[List[str]] = typer.Argument(None, metavar="PATH",
                                                        help="Files to migrate (default: every Git-Theta-format "
                                                             "tracked file)."),
            quiet: bool = QUIET_OPTION) -> None:
    """Rewrite the staged version of Git-Theta-format checkpoints in theta's format (then `git commit`)."""
    from theta.commands.migrate import migrate as do_migrate

    set_quiet(quiet)
    done = do_migrate(paths or [])
    if not done:
        note("nothing to migrate: no staged file is in Git-Theta's format")
        return
    head = gitutil.run_text(["rev-parse", "--short", "HEAD"], check=False) or "HEAD"
    for m in done:
        say(f"migrated {m.path}: {m.groups} groups now in theta's format; the result is staged")
    note(f"history up to {head} stays in Git-Theta's format (theta reads it); commit to finish")


@app.command("ls-files")
def ls_files(rev: Optional[str] = typer.Argument(None, metavar="REV", help="A revision (default: the index)."),
             as_json: bool = JSON_OPTION, quiet: bool = QUIET_OPTION) -> None:
    """Theta-tracked checkpoints with format, group count, size, stored size and whether every blob is local."""
    import dataclasses

    from theta.commands.ls_files import list_tracked
    from zipslice.progress import human_bytes as human

    set_quiet(quiet)
    files = sorted(list_tracked(rev), key=lambda f: natural_key(f.path))
    if as_json:  # size: bytes of the groups' values; stored: bytes of the distinct blobs that rebuild it
        emit_json({"rev": rev, "files": [dataclasses.asdict(f) for f in files]})
        return
    if not files:
        note("no theta-tracked checkpoints")
        return
    rows = [["format", "groups", "size", "blobs", "local", "path"]]
    rows += [[f.format, str(f.groups), human(f.size), human(f.stored), "yes" if f.local else "no",
              clistyle.printable(f.path)] for f in files]
    lines = clistyle.columns(rows, right=(1, 2, 3))
    if not clistyle.is_quiet():
        clistyle.out_console().print(lines[0], style="bold", markup=False)
    for line in lines[1:]:
        print(line)


@app.command()
def export(spec: str = typer.Argument(..., metavar="REV:PATH", help="A committed checkpoint, e.g. HEAD~2:model.pt."),
           out: Path = typer.Argument(..., metavar="OUT", help="Output file."),
           to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                            help="torch, safetensors or hdf5 (default: as committed).",
                                            **clistyle.one_of(("torch", "safetensors", "hdf5"), "format")),
           max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", metavar="SIZE",
                                                        help="Largest shard of a sharded OUT (default 5GB)."),
           quiet: bool = QUIET_OPTION) -> None:
    """Write a committed version of a checkpoint to OUT without touching the working tree.

    OUT named NAME.safetensors.index.json (or NAME.bin.index.json, NAME.h5.index.json) writes a sharded
    checkpoint: the index and shards NAME-00001-of-0000N.safetensors beside it, as transformers lays them out.
    """
    from theta.commands.export import export as do_export
    from theta.settings import parse_size

    set_quiet(quiet)
    limit = None
    if max_shard_size is not None:
        limit = parse_size(max_shard_size, "--max-shard-size")
        if limit <= 0:
            raise ThetaError(f"--max-shard-size {max_shard_size!r}: a shard must be allowed at least one byte")
    fmt = do_export(spec, out, to, max_shard_bytes=limit)
    note(f"wrote {out} ({fmt})")


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


# -- what git runs (hidden) -----------------------------------------------------------------------

_INTERNAL = ("filter-process", "clean", "smudge", "pre-push", "post-commit", "merge-driver", "diff-driver",
             "diff-textconv")


@app.command("filter-process", hidden=True)
def filter_process() -> None:
    """git's long-running filter (filter.theta.process); see `git-theta-filter -h`."""
    raise typer.Exit(filter_main([]))


def _stdin_chunks(bufsize: int = 1 << 20):
    while chunk := sys.stdin.buffer.read(bufsize):
        yield chunk


@app.command(hidden=True)
def clean(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file clean filter (fallback): checkpoint on stdin, metadata on stdout."""
    from theta.commands.filter.process import Filter

    filt = Filter(os.getcwd())
    try:
        data = filt.clean(path, _stdin_chunks())
    finally:
        filt.close()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@app.command(hidden=True)
def smudge(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file smudge filter (fallback): metadata on stdin, checkpoint on stdout."""
    from theta.commands.filter.process import Filter

    def send(f):
        while chunk := f.read(1 << 20):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    filt = Filter(os.getcwd())
    try:
        filt.smudge(path, _stdin_chunks(), send)
    finally:
        filt.close()


@app.command("post-commit", hidden=True)
def post_commit() -> None:
    """Git-Theta's post-commit hook body: theta needs none (blobs to push are found from the pushed commits)."""
    print("theta needs no post-commit hook: `git push` uploads the blobs the pushed commits reference "
          "(pre-push hook installed by `git theta install`); you can delete Git-Theta's .git/hooks/post-commit",
          file=sys.stderr)


@app.command("pre-push", hidden=True)
def pre_push(remote: str = typer.Argument(..., metavar="REMOTE"), url: str = typer.Argument("", metavar="URL")) -> None:
    """The pre-push hook: upload blobs referenced by pushed commits, then run the chained hook."""
    from theta.commands.hooks import run_pre_push

    raise typer.Exit(run_pre_push(remote, url, sys.stdin.buffer.read()))


_registered = False


def _register_areas() -> None:
    """Add every command area to the app, once."""
    global _registered
    if _registered:
        return
    _registered = True
    from theta.commands import care as cli_care
    from theta.commands import checkout as cli_checkout
    from theta.commands import merge as cli_merge
    from theta.commands import squash as cli_updates

    cli_updates.register(app)
    cli_merge.register(app)
    cli_care.register(app)
    cli_checkout.register(app)
    # last in `git theta -h`: about the command line itself
    app.command("help")(help_cmd)
    app.command("completion")(completion_cmd)


def _app() -> typer.Typer:
    """The app with every area's commands (registered once)."""
    _register_areas()
    return app


def run(args: list[str]) -> int:
    """Run `git theta ARGS...` (every command but the filter process); returns the exit status."""
    return clistyle.run(_app(), PROG, args, user_errors=(ThetaError,), error_status=1,
                        complete_var="_GIT_THETA_COMPLETE")
