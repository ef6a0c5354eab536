"""`git theta log`: a checkpoint's history group by group, as a picture (HTML page, PNG) or a line per commit;
and the picture of one pair for `git theta diff --html`.

The data comes from :mod:`theta.model.history` (metadata only, unless ``--exact``), the pictures from
:mod:`theta.commands.heatmap`. One page (and image) per tracked checkpoint: OUT is the file when there is one, a
directory of ``<path>.html`` files when there are several.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from zipslice import clistyle, optional
from zipslice.clistyle import emit_json, note, say
from zipslice.progress import human_bytes

from theta.base.errors import ThetaDependencyError, ThetaError
from theta.commands import heatmap
from theta.git import repo as gitutil
from theta.model import history
from theta.settings.merge_rules import MergeConfig


def split_revs_paths(args: list[str], argv: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Like git: the words before ``--`` are revisions (``A..B``, ``main``, ``-3``...), those after it paths;
    without ``--``, words that name revisions come first, then paths."""
    argv = sys.argv if argv is None else argv
    if "--" in argv:
        n_paths = len(argv) - argv.index("--") - 1
        if 0 <= n_paths <= len(args):
            return args[:len(args) - n_paths], args[len(args) - n_paths:]
    revs: list[str] = []
    for i, word in enumerate(args):
        if not gitutil.run_text(["rev-parse", "--revs-only", word], check=False):  # (a path: nothing)
            return revs, args[i:]
        revs.append(word)
    return revs, []


def outputs(out: Path, paths: list[str], suffix: str) -> dict[str, Path]:
    """Where each checkpoint's picture goes: ``out`` itself for one, ``out/<path><suffix>`` for several (``out``
    a directory then, never a file named like a picture)."""
    if len(paths) == 1 and not out.is_dir():
        return {paths[0]: out}
    if (out.exists() and not out.is_dir()) or (not out.exists() and out.suffix.lower() == suffix):
        raise ThetaError(f"{out}: {len(paths)} checkpoints changed, one picture each: name a directory "
                         f"(or one checkpoint: -- PATH)")
    return {p: out / (p.replace("/", "__") + suffix) for p in paths}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def png(h: history.History, path: Path) -> None:
    optional.require("matplotlib", "--png needs it", error=ThetaDependencyError)  # (before a file is made)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    heatmap.write_png(h, tmp)
    os.replace(tmp, path)


class _Progress:
    """``theta log PATH: i/n commits`` on stderr while it is a terminal."""

    def __init__(self, label: str):
        self.label, self.on = label, sys.stderr.isatty() and not clistyle.is_quiet()

    def __call__(self, i: int, n: int) -> None:
        if self.on:
            sys.stderr.write(f"\r{self.label}: {i}/{n} commits")
            sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def history_json(h: history.History) -> dict:
    return {"path": h.path, "groups": h.groups, "notes": h.notes,
            "commits": [dict(dataclasses.asdict(c), totals=dataclasses.asdict(t),
                             cells={h.groups[i]: dict(dataclasses.asdict(cell), relative=cell.relative)
                                    for i, cell in enumerate(row) if cell.status != "absent"})
                        for c, t, row in zip(h.commits, h.totals, h.cells)]}


def log_command(revs: list[str], paths: list[str], html: Path | None, png_out: Path | None, exact: bool,
                max_count: int | None, as_json: bool, cwd: str | os.PathLike = ".") -> None:
    repo = gitutil.toplevel(cwd)
    prefix = os.path.relpath(Path(cwd).resolve(), repo)
    rel = [os.path.normpath(os.path.join(prefix, p)) if prefix != "." else p for p in paths]
    found = history.tracked_paths(revs, rel, repo)
    if not found:
        raise ThetaError("no theta-tracked checkpoint changed in " + (" ".join(revs) or "HEAD")
                         + (f" under {' '.join(paths)}" if paths else ""))
    pages = outputs(html, found, ".html") if html is not None else {}
    images = outputs(png_out, found, ".png") if png_out is not None else {}
    docs = []
    for path in found:
        progress = _Progress(f"theta log {path}")
        try:
            h = history.file_history(path, revs, repo, exact=exact, max_count=max_count, progress=progress)
        finally:
            progress.done()
        if not h.commits or not h.groups:
            continue
        if path in pages:
            _write(pages[path], heatmap.log_page(h))
            say(f"wrote {pages[path]} ({len(h.commits)} commits, {len(h.groups)} groups)")
        if path in images:
            png(h, images[path])
            say(f"wrote {images[path]}")
        if as_json:
            docs.append(history_json(h))
        elif not pages and not images:
            _print_lines(h)
    if as_json:
        emit_json({"revs": revs, "files": docs})


def _print_lines(h: history.History) -> None:
    print(h.path)
    for c, t, row in zip(h.commits, h.totals, h.cells):
        rels = [cell.relative for cell in row if cell.status == "modified" and cell.relative is not None]
        top = max(rels) if rels else None
        print(f"  {c.id[:10]} {c.date[:10]} {t.changed:5d} groups changed  stored {human_bytes(t.stored):>9}  "
              f"clone fetches {human_bytes(t.fetch):>9}" + (f"  max |Δ|/|old| {top:.3g}" if top is not None else "")
              + f"  {clistyle.printable(c.subject)}")
    for line in h.notes:
        note(f"note: {line}")


def diff_html(revs: list[str], paths: list[str], out: Path, exact: bool, cwd: str | os.PathLike = ".") -> int:
    """`git theta diff --html OUT A B [-- PATH...]`: a page per checkpoint that differs; returns how many."""
    if len(revs) != 2:
        raise ThetaError("git theta diff --html compares two commits: git theta diff --html OUT A B [-- PATH...]")
    repo = gitutil.toplevel(cwd)
    prefix = os.path.relpath(Path(cwd).resolve(), repo)
    rel = [os.path.normpath(os.path.join(prefix, p)) if prefix != "." else p for p in paths]
    changed = [p for p in gitutil.run(["diff-tree", "-r", "-z", "--name-only", "--no-renames", revs[0], revs[1],
                                       "--", *rel], cwd=repo).decode("utf-8").split("\0") if p]
    attrs = gitutil.check_attr("filter", changed, repo)
    found = [p for p in changed if attrs.get(p) == "theta"]
    if not found:
        note(f"no theta-tracked checkpoint differs between {revs[0]} and {revs[1]}")
        return 0
    pages = outputs(out, found, ".html")
    config = None
    for path in found:
        h = history.pair_history(revs[0], revs[1], path, repo, exact=exact)
        merge = None
        decisions = history.merge_decisions(h.commits[0], path, repo)
        if decisions is not None:
            config = config or MergeConfig.load(repo)
            merge = {}
            for name, d in decisions.items():
                strategy = ""
                if d.both:
                    choice = config.choose(path, name)
                    strategy = (f"strategy configured now: {choice.strategy} ({choice.source})" if choice.strategy
                                else "no strategy configured now")
                merge[name] = heatmap.MergeRow(d.decision, strategy)
        _write(pages[path], heatmap.diff_page(h, revs[0], merge))
        say(f"wrote {pages[path]} ({h.totals[0].changed} of {len(h.groups)} groups differ)")
    return len(found)
