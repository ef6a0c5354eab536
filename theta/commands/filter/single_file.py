"""`git-theta clean PATH` and `git-theta smudge PATH`: the single-file filters (git's `filter.theta.clean` /
`filter.theta.smudge`), used where git does not run the long-running filter process."""
from __future__ import annotations

import os
import sys

import typer


def _stdin_chunks(bufsize: int = 1 << 20):
    while chunk := sys.stdin.buffer.read(bufsize):
        yield chunk


def clean(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file clean filter (fallback): checkpoint on stdin, metadata on stdout."""
    from theta.commands.filter.session import Filter

    filt = Filter(os.getcwd())
    try:
        data = filt.clean(path, _stdin_chunks())
    finally:
        filt.close()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def smudge(path: str = typer.Argument("", metavar="PATH", help="The path git passes as %f.")) -> None:
    """Single-file smudge filter (fallback): metadata on stdin, checkpoint on stdout."""
    from theta.commands.filter.session import Filter

    def send(f):
        while chunk := f.read(1 << 20):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    filt = Filter(os.getcwd())
    try:
        filt.smudge(path, _stdin_chunks(), send)
    finally:
        filt.close()
