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
                  help="Version ML checkpoints in git, parameter group by parameter group, with groups in Git LFS.")


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
        update_data: Optional[Path] = typer.Option(None, "--update-data", help="A file holding the update (side-loaded)."),
        option: List[str] = typer.Option([], "--option", "-o", help="KEY=VALUE clean option (GIT_THETA_KEY)."),
        ) -> None:
    """`git add` with clean options; they reach the filter as GIT_THETA_* environment variables."""
    env = dict(os.environ)
    if update_type:
        env["GIT_THETA_UPDATE_TYPE"] = update_type
    if update_data:
        env["GIT_THETA_UPDATE_DATA"] = str(update_data.resolve())
    for kv in option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ThetaError(f"--option expects KEY=VALUE, got {kv!r}")
        env["GIT_THETA_" + key.upper().replace("-", "_")] = value
    raise typer.Exit(gitutil.passthrough(["add", *ctx.args, *paths], env=env))


@app.command("ls-files")
def ls_files(rev: Optional[str] = typer.Argument(None, help="A revision (default: the index).")) -> None:
    """Theta-tracked checkpoints with group count, size and stored size."""
    from theta.commands.lsfiles import list_tracked
    from zipslice.progress import human_bytes as human

    files = list_tracked(rev)
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


@app.command("pre-push", hidden=True)
def pre_push(remote: str, url: str = typer.Argument("")) -> None:
    """The pre-push hook: upload blobs referenced by pushed commits, then run the chained hook."""
    from theta.commands.hooks import run_pre_push

    raise typer.Exit(run_pre_push(remote, url, sys.stdin.buffer.read()))


def _register_areas() -> None:
    from theta.commands import checkout as cli_checkout
    from theta.commands import merge as cli_merge
    from theta.commands import squash as cli_updates

    cli_updates.register(app)
    cli_merge.register(app)
    cli_checkout.register(app)


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
    except KeyboardInterrupt:  # Ctrl-C reaches git and its filter alike: git reports it; files stay as they are
        return 130


if __name__ == "__main__":
    sys.exit(main())
