"""What the filter process says on stderr: stdout carries git's protocol only."""
from __future__ import annotations

import sys
import traceback

from theta import settings
from theta.base.errors import ThetaError


def log(msg: str) -> None:
    print(f"git-theta: {msg}", file=sys.stderr, flush=True)


def report_error(path: str, command: str | None, e: Exception) -> None:
    """One line naming the request's command and path, and the problem (a traceback with GIT_THETA_DEBUG)."""
    if isinstance(e, ThetaError):
        log(f"error: {command} {path}: {e}")
    else:
        log(f"error: {command} {path}: {type(e).__name__}: {e}")
        if settings.env("DEBUG"):
            traceback.print_exc(file=sys.stderr)
