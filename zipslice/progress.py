"""Progress on stderr, shown only when stderr is a terminal (never on a pipe, never on stdout).

The one progress helper of zipslice and theta: a rich bar with the real file name, bytes and rate. When
disabled (not a terminal, or ``enabled=False``) every method is a no-op, so callers need no branches.
"""
from __future__ import annotations

import sys
import threading


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes shown whole)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_shown = threading.Lock()
_live: dict = {"progress": None, "bars": 0}  # the one rich display all active bars share


class Bar:
    """A transient byte-progress bar on stderr; a no-op unless ``active``. Bars active at the same time (a
    download and the rebuild fed by it) are lines of one display: a terminal has one live display."""

    def __init__(self, label: str, total: int | None = None, enabled: bool = True):
        self.active = bool(enabled) and sys.stderr.isatty()
        self._p = None
        if not self.active:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        with _shown:
            if _live["progress"] is None:
                _live["progress"] = Progress(TextColumn("{task.description}"), BarColumn(),
                                             DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                             TimeRemainingColumn(), console=Console(stderr=True), transient=True)
                _live["progress"].start()
            _live["bars"] += 1
            self._p = _live["progress"]
            self._task = self._p.add_task(label, total=total)

    def advance(self, n: int, total: int | None = None) -> None:
        """Count ``n`` more bytes done (and set the total when it becomes known)."""
        if self._p is not None:
            if total is not None:
                self._p.update(self._task, total=total, advance=n)
            else:
                self._p.advance(self._task, n)

    def close(self) -> None:
        if self._p is None:
            return
        with _shown:
            self._p.refresh()  # its last figures drawn (the bar is then cleared with its line)
            self._p.remove_task(self._task)
            _live["bars"] -= 1
            if _live["bars"] == 0:
                self._p.stop()
                _live["progress"] = None
            self._p = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
