"""Fault injection for the fault suite (tests/hostile/test_faults.py): ``GIT_THETA_FAULT=<point>[:<n>]`` makes
the process kill itself with SIGKILL -- no cleanup at all, as the OOM killer or ``kill -9`` would -- the
``n``-th time (default: first) it reaches ``<point>``. Unset (always, outside those tests), :func:`point`
costs one comparison.

Points: ``clean:received`` (content spooled, nothing cleaned), ``store:written`` (a blob's bytes written,
not yet under its name), ``store:published`` (a blob under its name), ``clean:done`` (metadata made, not sent),
``smudge:fetched`` (blobs local, no byte sent), ``smudge:group`` (a group rebuilt and handed to the writer),
``smudge:done`` (the file sent, status not), ``materialize:swapped`` (a materialized checkpoint swapped with its
placeholder, the placeholder not yet removed nor the index updated).
"""
from __future__ import annotations

import os
import signal

_SPEC: str | None = os.environ.get("GIT_THETA_FAULT") or None
_NAME, _, _NTH = (_SPEC or "").rpartition(":")
if not _NTH.isdigit():  # no count: the whole spec is the point's name
    _NAME, _NTH = _SPEC or "", "1"
_seen = 0


def point(name: str) -> None:
    """Die here (SIGKILL) if GIT_THETA_FAULT names this point (and this is its n-th visit)."""
    global _seen
    if _SPEC is None or name != _NAME:
        return
    _seen += 1
    if _seen >= int(_NTH):
        os.kill(os.getpid(), signal.SIGKILL)
