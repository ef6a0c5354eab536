"""The single-file filters: ``git-theta-filter clean PATH`` / ``git-theta-filter smudge PATH`` (also
``git-theta clean|smudge PATH``): one file from stdin to stdout, for git's ``filter.<driver>.clean`` /
``.smudge`` keys (gitattributes(5): ``%f`` is the path).

Git-Theta's `git theta install` writes ``filter.theta.clean = git-theta-filter clean %f`` and ``filter.theta.smudge
= git-theta-filter smudge %f``; theta installs commands of those names, so a repository set up by Git-Theta works
with theta before `git theta install` replaces the keys with the long-running filter (which git prefers when both
are set: one process for a whole add or checkout).

Each command is one request of the long-running filter (:class:`theta.commands.filter.session.Filter`): the
same clean, the same smudge, so the same output bytes for the same input, except that a smudge always writes
the checkpoint itself: there is no end of a checkout to materialize a placeholder at. A torch checkpoint streams
to stdout while it is rebuilt; other formats go through a temporary file. stdout carries only the data;
messages go to stderr. No typer here: `git-theta-filter` imports this module without the CLI's modules
(:mod:`theta.commands.entry`). A failure exits non-zero (git then fails the add or checkout, ``filter.theta.required``);
a smudge that fails after its first byte has left a partial output, which git discards with the exit status.
"""
from __future__ import annotations

import os
import sys
from typing import BinaryIO, Iterator

from theta.base.errors import ThetaError

COMMANDS = ("clean", "smudge")
READ_BYTES = 1 << 20


def chunks(stream: BinaryIO, size: int = READ_BYTES) -> Iterator[bytes]:
    while chunk := stream.read(size):
        yield chunk


def run(command: str, path: str, stdin: BinaryIO, stdout: BinaryIO, cwd: "str | os.PathLike" = ".") -> None:
    """Filter ``stdin`` to ``stdout`` as ``command`` ("clean" or "smudge") of the file ``path`` (relative to the
    work tree's top, as git's ``%f``); raises ThetaError on failure."""
    # (here, not at the top: every `git theta` command imports this module through app.py's command table and
    # need not load the filter's store, codec and numpy)
    from theta.commands.filter.session import Filter
    from theta.commands.hooks import ensure_installed_quietly

    if command not in COMMANDS:
        raise ValueError(command)
    ensure_installed_quietly(cwd)  # as the long-running filter does: a fresh clone gets theta's pre-push hook
    filt = Filter(cwd, single_file=True)
    try:
        if command == "clean":
            stdout.write(filt.clean(path, chunks(stdin)))
        else:
            def send(f):
                while chunk := f.read(READ_BYTES):
                    stdout.write(chunk)

            filt.smudge(path, chunks(stdin), send, stream=lambda: stdout)
        stdout.flush()
    finally:
        filt.close()


def main(command: str, args: list[str]) -> int:
    """``git-theta-filter clean|smudge PATH``: the exit status (messages on stderr, data alone on stdout)."""
    if len(args) != 1:
        print(f"git-theta-filter: error: {command} takes the file's path (git's %f), got {len(args)} "
              f"argument(s) (see git-theta-filter -h)", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        what = "checkpoint" if command == "clean" else "metadata text"
        print(f"git-theta-filter: error: {command} reads the {what} on stdin (git runs it as a filter; see "
              f"git-theta-filter -h)", file=sys.stderr)
        return 2
    try:
        run(command, args[0], sys.stdin.buffer, sys.stdout.buffer, os.getcwd())
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, as the long-running filter reports a file's failure to git
        from zipslice.clistyle import one_line

        what = one_line(e) if isinstance(e, ThetaError) else f"{type(e).__name__}: {e}"
        print(f"git-theta-filter: error: {command} {args[0]}: {what}", file=sys.stderr)
        return 1
    return 0
