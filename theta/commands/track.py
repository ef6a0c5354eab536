"""`git theta track PATTERN...`: mark paths as theta checkpoints in the repository's .gitattributes.

Each pattern gets ``filter=theta diff=theta merge=theta``. Other attributes already on that pattern's line
are kept; a different filter/diff/merge driver on it (e.g. ``filter=lfs``) is refused rather than replaced.
Idempotent: tracking a tracked pattern changes nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer

from theta.git import repo as gitutil
from theta.base.errors import TrackError
from zipslice.clistyle import QUIET_OPTION, note, say, set_quiet

DRIVERS = ("filter", "diff", "merge")
OURS = {d: "theta" for d in DRIVERS}


@dataclass
class Line:
    raw: str
    pattern: str | None = None
    attrs: list[str] | None = None

    def render(self) -> str:
        if self.pattern is None:
            return self.raw
        return " ".join([quote_pattern(self.pattern), *self.attrs])


def quote_pattern(p: str) -> str:
    if re.search(r'[\s"\\]', p):
        return '"' + p.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return p


def parse_line(raw: str) -> Line:
    s = raw.strip()
    if not s or s.startswith("#"):
        return Line(raw)
    if s.startswith('"'):
        m = re.match(r'"((?:[^"\\]|\\.)*)"\s*(.*)$', s)
        if not m:
            return Line(raw)
        pattern = re.sub(r"\\(.)", r"\1", m.group(1))
        rest = m.group(2)
    else:
        pattern, _, rest = s.partition(" ") if " " in s else s.partition("\t")
    return Line(raw, pattern, rest.split())


def _attr_name(a: str) -> str:
    return a.lstrip("-!").split("=", 1)[0]


def track_lines(lines: list[Line], pattern: str) -> tuple[list[Line], bool]:
    """The lines with ``pattern`` tracked, and whether anything changed. Raises TrackError on a conflict."""
    for line in lines:
        if line.pattern != pattern:
            continue
        kept = []
        for a in line.attrs:
            name = _attr_name(a)
            if name in DRIVERS:
                if "=" in a and a.split("=", 1)[1] != "theta":
                    raise TrackError(f".gitattributes: {pattern!r} already has {a}; untrack it from that tool "
                                     f"first (e.g. `git lfs untrack {pattern}`), then rerun `git theta track`")
                if a == f"{name}=theta":
                    continue
                continue  # -diff, !merge, bare "diff": superseded by the theta driver
            kept.append(a)
        new_attrs = kept + [f"{d}=theta" for d in DRIVERS]
        if new_attrs == line.attrs:
            return lines, False
        line.attrs = new_attrs
        return lines, True
    return lines + [Line("", pattern, [f"{d}=theta" for d in DRIVERS])], True


def track(patterns: list[str], cwd=None) -> list[str]:
    """Track ``patterns`` in <toplevel>/.gitattributes; returns the patterns newly tracked."""
    for p in patterns:
        if not p.strip():
            raise TrackError("empty pattern")
    return _edit_attributes(gitutil.toplevel(cwd) / ".gitattributes", patterns, track_lines)


def untrack_lines(lines: list[Line], pattern: str) -> tuple[list[Line], bool]:
    """The lines with theta's drivers removed from ``pattern``'s line(s) (a line left without attributes is
    dropped, as `git lfs untrack` does), and whether anything changed."""
    out, changed = [], False
    for line in lines:
        if line.pattern != pattern:
            out.append(line)
            continue
        kept = [a for a in line.attrs if a not in {f"{d}=theta" for d in DRIVERS}]
        if kept != line.attrs:
            changed = True
            line.attrs = kept
        if line.attrs:
            out.append(line)
    return out, changed


def untrack(patterns: list[str], cwd=None) -> list[str]:
    """Stop tracking ``patterns`` in <toplevel>/.gitattributes; returns the patterns that were tracked.

    Files already committed keep their metadata in history; a file added again after this is stored by
    git as it is (or by another filter tracking it)."""
    path = gitutil.toplevel(cwd) / ".gitattributes"
    if not path.exists():
        return []
    return _edit_attributes(path, patterns, untrack_lines)


def _edit_attributes(path: Path, patterns: list[str], edit) -> list[str]:
    """Apply ``edit(lines, pattern) -> (lines, changed)`` for each pattern to the .gitattributes at ``path``,
    written back atomically when anything changed; the patterns that changed it."""
    text = path.read_text() if path.exists() else ""
    lines = [parse_line(r) for r in text.splitlines()]
    changed = []
    for p in patterns:
        lines, did = edit(lines, p)
        if did:
            changed.append(p)
    if changed:
        tmp = path.with_name(".gitattributes.theta.tmp")
        tmp.write_text("".join(line.render() + "\n" for line in lines))
        tmp.replace(path)
    return changed


def tracked_patterns(cwd=None) -> list[str]:
    path = gitutil.toplevel(cwd) / ".gitattributes"
    if not path.exists():
        return []
    return [ln.pattern for ln in map(parse_line, path.read_text().splitlines())
            if ln.pattern and "filter=theta" in ln.attrs]


# -- the verbs ------------------------------------------------------------------------------------

def track_command(patterns: Optional[List[str]] = typer.Argument(None, metavar="PATTERN",
                                                          help="gitattributes patterns, e.g. '*.pt'."),
          quiet: bool = QUIET_OPTION) -> None:
    """Mark paths as theta checkpoints in .gitattributes (filter=theta diff=theta merge=theta).

    Without a pattern: list the patterns tracked now (like `git lfs track`)."""
    set_quiet(quiet)
    if not patterns:
        listed = tracked_patterns()
        note("Listing tracked patterns" if listed else "no patterns are tracked by theta")
        for p in listed:
            print(f"    {p}")
        return
    changed = set(track(patterns))
    for p in patterns:
        say(f"{'Tracking' if p in changed else 'Already tracking'} {p}")


def untrack_command(patterns: List[str] = typer.Argument(..., help="Patterns to stop tracking, as listed by "
                                                 "`git theta track`.")) -> None:
    """Remove theta's filter/diff/merge from patterns in .gitattributes (committed history is unchanged)."""
    changed = set(untrack(patterns))
    for p in patterns:
        print(f"{'Untracking' if p in changed else 'Not tracked by theta:'} {p}")
