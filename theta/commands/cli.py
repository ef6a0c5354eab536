"""`git theta ...`: the command line (typer). Every ThetaError becomes `error: <message>` and exit status 1."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from theta.errors import ThetaError
from theta.git import repo as gitutil

app = typer.Typer(name="git-theta", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
                  help="Version ML checkpoints in git, parameter group by parameter group, with groups in Git LFS.")


def version() -> str:
    """This installation's version (package metadata; the source tree's pyproject when not installed)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("zipslice-theta")
    except PackageNotFoundError:
        return "0+source"  # running from a source tree that was never installed


def _print_version(value: bool) -> None:
    if value:
        print(f"git-theta {version()}")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                            help="Print the version and exit.")) -> None:
    """Version ML checkpoints in git, parameter group by parameter group, with groups in Git LFS."""


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


@app.command()
def install(local: bool = typer.Option(False, "--local", help="Configure this repository only.")) -> None:
    """Configure git for theta (global by default) and install this repository's hooks."""
    from theta.commands.install import install as do_install

    report = do_install(local=local)
    for line in report.changed:
        print(line)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if not report.changed:
        print("git-theta is already installed")


@app.command()
def track(patterns: Optional[List[str]] = typer.Argument(None, help="gitattributes patterns, e.g. '*.pt'")) -> None:
    """Mark paths as theta checkpoints in .gitattributes (filter=theta diff=theta merge=theta).

    Without a pattern: list the patterns tracked now (like `git lfs track`)."""
    from theta.commands.track import track as do_track, tracked_patterns

    if not patterns:
        listed = tracked_patterns()
        print("Listing tracked patterns" if listed else "no patterns are tracked by theta", file=sys.stderr)
        for p in listed:
            print(f"    {p}")
        return
    changed = set(do_track(patterns))
    for p in patterns:
        print(f"{'Tracking' if p in changed else 'Already tracking'} {p}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def add(ctx: typer.Context,
        paths: List[str] = typer.Argument(..., help="Paths to add (and any `git add` options)."),
        update_type: Optional[str] = typer.Option(None, "--update-type", help="dense, sparse, low-rank, ia3, delta or auto."),
        update_data: Optional[Path] = typer.Option(None, "--update-data", "--update-path",
                                                   help="A file holding the update (side-loaded; Git-Theta's "
                                                        "README spells it --update-path)."),
        option: List[str] = typer.Option([], "--option", "-o", help="KEY=VALUE clean option (GIT_THETA_KEY)."),
        checkpoint_type: Optional[str] = typer.Option(None, "--checkpoint-type", hidden=True,
                                                      help="Git-Theta's option: theta reads the format from the "
                                                           "file's bytes; use --format to change the committed one."),
        format: Optional[str] = typer.Option(None, "--format", help="Change the committed format to torch, "
                                             "safetensors or hdf5 (whatever format the work-tree file has)."),
        ) -> None:
    """`git add` with clean options; they reach the filter as GIT_THETA_* environment variables.

    A file keeps the format it was committed in, whatever format it is checked out in (a view); `--format`
    is the one way to change it: the paths are cleaned again (`git add --renormalize`) and recorded as FORMAT.
    """
    env = dict(os.environ)
    if checkpoint_type:
        print(f"note: --checkpoint-type {checkpoint_type} is not needed: theta detects the checkpoint format "
              f"from the file (use --format to change the committed format)", file=sys.stderr)
    if update_type and update_data:
        # Git-Theta's workflow: the work tree may hold the ORIGINAL checkpoint; make it previous-with-update
        from theta.commands.sideload_add import prepare

        for note in prepare([p for p in paths if not p.startswith("-")], update_type, update_data):
            print(note, file=sys.stderr)
    if update_type:
        env["GIT_THETA_UPDATE_TYPE"] = update_type
    if update_data:
        env["GIT_THETA_UPDATE_DATA"] = str(update_data.resolve())
    for kv in option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ThetaError(f"--option expects KEY=VALUE, got {kv!r}")
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
    raise typer.Exit(gitutil.passthrough(["add", *ctx.args, *paths], env=env))


@app.command()
def migrate(paths: Optional[List[str]] = typer.Argument(None, help="Files to migrate (default: every "
                                                                   "Git-Theta-format tracked file).")) -> None:
    """Rewrite the staged version of Git-Theta-format checkpoints in theta's format (then `git commit`)."""
    from theta.commands.migrate import migrate as do_migrate

    done = do_migrate(paths or [])
    if not done:
        print("nothing to migrate: no staged file is in Git-Theta's format", file=sys.stderr)
        return
    head = gitutil.run_text(["rev-parse", "--short", "HEAD"], check=False) or "HEAD"
    for m in done:
        print(f"migrated {m.path}: {m.groups} groups now in theta's format; the result is staged")
    print(f"history up to {head} stays in Git-Theta's format (theta reads it); commit to finish", file=sys.stderr)


@app.command("ls-files")
def ls_files(rev: Optional[str] = typer.Argument(None, help="A revision (default: the index)."),
             as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
             ) -> None:
    """Theta-tracked checkpoints with group count, size and stored size."""
    import dataclasses
    import json

    from theta.commands.lsfiles import list_tracked
    from zipslice.progress import human_bytes as human

    files = list_tracked(rev)
    if as_json:
        sys.stdout.write(json.dumps({"rev": rev, "files": [dataclasses.asdict(f) for f in files]}, indent=2,
                                    sort_keys=True) + "\n")
        return
    if not files:
        print("no theta-tracked checkpoints", file=sys.stderr)
        return
    width = max(len(f.path) for f in files)
    print(f"{'path':<{width}}  {'format':<11} {'groups':>6} {'size':>10} {'blobs':>10}  local")
    for f in files:
        print(f"{f.path:<{width}}  {f.format:<11} {f.groups:>6} {human(f.size):>10} {human(f.stored):>10}  "
              f"{'yes' if f.local else 'no'}")


@app.command()
def export(spec: str = typer.Argument(..., help="REV:PATH, e.g. HEAD~2:model.pt"),
           out: Path = typer.Argument(..., help="Output file."),
           to: Optional[str] = typer.Option(None, "--to", help="torch, safetensors or hdf5 (default: as committed)."),
           ) -> None:
    """Write a committed version of a checkpoint to OUT without touching the working tree."""
    from theta.commands.export import export as do_export

    fmt = do_export(spec, out, to)
    print(f"wrote {out} ({fmt})", file=sys.stderr)


@app.command("filter-process")
def filter_process() -> None:
    """git's long-running filter (filter.theta.process)."""
    from theta.commands.filter_process import serve

    raise typer.Exit(serve(sys.stdin.buffer, sys.stdout.buffer, os.getcwd()))


def _stdin_chunks(bufsize: int = 1 << 20):
    while chunk := sys.stdin.buffer.read(bufsize):
        yield chunk


@app.command()
def clean(path: str = typer.Argument("", help="The path git passes as %f.")) -> None:
    """Single-file clean filter (fallback): checkpoint on stdin, metadata on stdout."""
    from theta.commands.filter_process import Filter

    data = Filter(os.getcwd()).clean(path, _stdin_chunks())
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@app.command()
def smudge(path: str = typer.Argument("", help="The path git passes as %f.")) -> None:
    """Single-file smudge filter (fallback): metadata on stdin, checkpoint on stdout."""
    from theta.commands.filter_process import Filter

    def send(f):
        while chunk := f.read(1 << 20):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    Filter(os.getcwd()).smudge(path, _stdin_chunks(), send)


@app.command("post-commit", hidden=True)
def post_commit() -> None:
    """Git-Theta's post-commit hook body: theta needs none (blobs to push are found from the pushed commits)."""
    print("theta needs no post-commit hook: `git push` uploads the blobs the pushed commits reference "
          "(pre-push hook installed by `git theta install`); you can delete Git-Theta's .git/hooks/post-commit",
          file=sys.stderr)


@app.command("pre-push", hidden=True)
def pre_push(remote: str, url: str = typer.Argument("")) -> None:
    """The pre-push hook: upload blobs referenced by pushed commits, then run the chained hook."""
    from theta.commands.hooks import run_pre_push

    raise typer.Exit(run_pre_push(remote, url, sys.stdin.buffer.read()))


def _register_areas() -> None:
    from theta.commands import care as cli_care
    from theta.commands import merge as cli_merge
    from theta.commands import squash as cli_updates

    cli_updates.register(app)
    cli_merge.register(app)
    cli_care.register(app)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["filter-process"]:  # the hot path git starts for every add/checkout: skip building the CLI
        return filter_main()
    _register_areas()
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ThetaError as e:
        _err(str(e))
        return 1
    return 0


def filter_main() -> int:
    """The `git-theta-filter` entry point: the long-running filter process."""
    from theta.commands.filter_process import serve

    try:
        return serve(sys.stdin.buffer, sys.stdout.buffer, os.getcwd())
    except ThetaError as e:
        _err(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
