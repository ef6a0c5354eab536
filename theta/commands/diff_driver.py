"""Model-aware diffs: git's external diff driver (`git-theta diff-driver`) and `git theta diff`.

git calls the driver with 7 arguments ``path old-file old-hex old-mode new-file new-hex new-mode`` for
`git diff`, `git show`, `git log -p` on paths with ``diff=theta``. Each file is either theta metadata (from
the index or a commit) or, for the working-tree side of `git diff`, the checkpoint itself; ``/dev/null`` for
an added or removed file. Output goes to stdout, coloured (rich) when stdout is a terminal or git's pager.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Sequence, TextIO

from rich.console import Console
from rich.markup import escape

from zipslice.clistyle import jsonable

from theta import settings
from theta.base import valuehash
from theta.base.errors import MetadataError, ThetaError
from theta.git import repo as gitutil
from theta.model.diff import (CheckpointSide, FileDiff, GroupDiff, GroupInfo, MetaSide, OpaqueSide, Side,
                              checkpoint_or_opaque, diff_sides)
from theta.peers.gittheta.files import GitThetaFile, GitThetaSide, is_git_theta
from theta.storage.committed import committed_meta
from theta.storage.metadata import is_metadata, loads
from theta.storage.store import LfsStore
from theta.updates.bounds import check_output

STYLE = {"added": "green", "removed": "red", "modified": "yellow", "reshaped": "magenta", "retyped": "magenta"}


def _shape(i: GroupInfo) -> str:
    return f"{i.dtype} [{', '.join(map(str, i.shape))}]"


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3e}"


def group_line(g: GroupDiff) -> str:
    """One group of the report, as rich markup."""
    style = STYLE[g.status]
    head = f"[{style}]{g.status:<9}[/] {printable(g.name)}"
    if g.status == "added":
        return f"{head}  {_shape(g.new)}"
    if g.status == "removed":
        return f"{head}  {_shape(g.old)}"
    if g.status in ("reshaped", "retyped"):
        return f"{head}  {_shape(g.old)} -> {_shape(g.new)}"
    update = f"  update {g.new.update}" + (f" (chain {g.new.chain})" if g.new.chain > 1 else "") if g.new.update else ""
    if g.stats is not None:
        s = g.stats
        return (f"{head}  {_shape(g.new)}{update}  |Δ|₂ {_num(s.l2)}  rel {_num(s.relative)}  "
                f"max|Δ| {_num(s.max_abs)}  changed {100 * s.fraction:.2f}% ({s.changed:,}/{s.numel:,})")
    if g.estimate is not None:
        return f"{head}  {_shape(g.new)}{update}  |Δ|₂ ≈ {_num(g.estimate)} (LSH estimate)"
    return f"{head}  {_shape(g.new)}{update}  (no LSH signature to estimate from)"


def summary_line(fd: FileDiff) -> str:
    parts = [f"{fd.count(s)} {s}" for s in ("modified", "added", "removed", "reshaped", "retyped") if fd.count(s)]
    parts.append(f"{fd.unchanged} unchanged")
    text = ", ".join(parts)
    changed, total = fd.changed_elements
    if total:
        text += f"; |Δ|₂ total {_num(fd.total_l2)}, {changed:,} of {total:,} elements of modified groups changed " \
                f"({100 * changed / total:.2f}%)"
    elif fd.estimated and fd.count("modified"):
        text += " (distances are LSH estimates)"
    return text


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` for the terminal: rich markup escaped, control characters (a name from a checkpoint someone
    else wrote could carry terminal escape sequences) shown as \\xNN."""
    return escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def render(fd: FileDiff, console: Console, stat: bool = False) -> None:
    fmt = fd.new_format or fd.old_format
    if fd.old_format and fd.new_format and fd.old_format != fd.new_format:
        fmt = f"{fd.old_format} -> {fd.new_format}"
    state = " (new file)" if fd.old_format is None else " (deleted)" if fd.new_format is None else ""
    if stat:
        console.print(f"[bold]{escape(fd.path)}[/] | {summary_line(fd)}", highlight=False)
        return
    console.print(f"[bold]theta diff {escape(fd.path)}[/] ({fmt}){state}", highlight=False)
    for note in fd.notes:
        console.print(f"  [cyan]note[/]      {printable(note)}", highlight=False, soft_wrap=True)
    for g in fd.groups:
        console.print("  " + group_line(g), highlight=False, soft_wrap=True)
    console.print(f"  [bold]{summary_line(fd)}[/]", highlight=False, soft_wrap=True)


def make_console(out: TextIO | None = None, color: bool | None = None) -> Console:
    out = out or sys.stdout
    if color is None:
        color = out.isatty() or os.environ.get("GIT_PAGER_IN_USE", "").lower() in ("1", "true")
        color = color and "NO_COLOR" not in os.environ
    return Console(file=out, force_terminal=color, no_color=not color, color_system="standard" if color else None,
                   highlight=False, width=10_000 if not out.isatty() else None, soft_wrap=True)


def side_from_file(file: str, label: str, repo_dir: str | os.PathLike) -> Side | None:
    """A diff side from a file git gave us: None for /dev/null, metadata, or a checkpoint file."""
    if file == os.devnull or not os.path.exists(file):
        return None
    with open(file, "rb") as f:
        head = f.read(64)
    if is_metadata(head):
        return meta_side(loads(Path(file).read_bytes(), file=label), label, repo_dir)
    if not head:
        return None
    return checkpoint_or_opaque(file, label)


def meta_side(meta, label: str, repo_dir) -> Side:
    """A side for committed metadata: a checkpoint's, or one opaque blob's. Metadata declaring more than
    theta.maxCheckoutBytes is refused before any value is rebuilt (it came with a clone: untrusted)."""
    if meta.is_opaque:
        return OpaqueSide(meta.opaque, label)
    check_output(meta, label, settings.max_checkout_bytes(repo_dir))
    return MetaSide(meta, label, repo_dir)


def driver_main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """git's external diff: ``path old-file old-hex old-mode new-file new-hex new-mode [...]``."""
    if len(argv) < 7:
        sys.stderr.write("theta diff-driver: git calls this with 7 arguments "
                         "(path old-file old-hex old-mode new-file new-hex new-mode)\n")
        return 2
    path, old_file, new_file = argv[0], argv[1], argv[4]
    try:
        old = side_from_file(old_file, path, ".")
        new = side_from_file(new_file, path, ".")
        fd = diff_sides(old, new, path, estimate=settings.env_flag("DIFF_ESTIMATE"))
        render(fd, make_console(out), stat=settings.env_flag("DIFF_STAT"))
    except ThetaError as e:
        sys.stderr.write(f"theta diff-driver: {path}: {e}\n")
        return 1
    return 0


# ---------- `git theta diff [REV [REV]] [-- PATH...]` ---------------------------------------------------------

def theta_paths(paths: list[str], repo: Path) -> list[str]:
    """The paths (relative to the top) whose ``filter`` attribute is theta."""
    return [p for p, v in gitutil.check_attr("filter", paths, repo).items() if v == "theta"]


def _names(args: list[str], repo: Path) -> list[str]:
    return [p for p in gitutil.run(args, cwd=repo).decode("utf-8").split("\0") if p]


def _meta_at(spec: str, repo: Path, label: str) -> Side | None:
    """The metadata stored in git at ``spec`` (e.g. ``HEAD:model.pt`` or ``:model.pt``), None if absent."""
    data = gitutil.read_blob(spec, repo)
    if data is None:
        return None
    if not is_metadata(data[:64]):
        if is_git_theta(data):  # committed by Git-Theta: its values, rebuilt as Git-Theta checks them out
            path = spec.split(":", 1)[1]
            return GitThetaSide(GitThetaFile(data, path, repo, LfsStore.for_repo(repo), label=spec), label)
        raise ThetaError(f"{spec} is not theta metadata (committed without the theta filter?)")
    return meta_side(loads(data, file=spec), label, repo)


def file_diffs(revs: list[str], paths: list[str], estimate: bool = False,
               cwd: str | os.PathLike = ".") -> Iterator[FileDiff]:
    """The model diff of each theta-tracked path that differs (see :func:`diff_command` for the sides)."""
    if len(revs) > 2:
        raise ThetaError("git theta diff takes at most two revisions")
    repo = gitutil.toplevel(cwd)
    prefix = os.path.relpath(Path(cwd).resolve(), repo)
    rel = [os.path.normpath(os.path.join(prefix, p)) if prefix != "." else p for p in paths]
    spec = ["--", *rel] if rel else []
    if len(revs) == 2:
        changed = _names(["diff-tree", "-r", "-z", "--name-only", "--no-renames", revs[0], revs[1], *spec], repo)
    elif len(revs) == 1:
        changed = _names(["diff-index", "-z", "--name-only", "--no-renames", revs[0], *spec], repo)
    else:  # index vs working tree, by stat (plumbing: never runs the clean filter)
        changed = _names(["diff-files", "-z", "--name-only", *spec], repo)
    for path in theta_paths(changed, repo):
        if len(revs) == 2:
            old = _meta_at(f"{revs[0]}:{path}", repo, path)
            new = _meta_at(f"{revs[1]}:{path}", repo, path)
        else:
            old = _meta_at(f"{revs[0]}:{path}" if revs else f":{path}", repo, path)
            new = side_from_file(str(repo / path), path, repo) if (repo / path).exists() else None
        try:
            fd = diff_sides(old, new, path, estimate=estimate)
            if isinstance(old, MetaSide) and isinstance(new, CheckpointSide) and new.format != old.format:
                # the work-tree file is a view (theta.model.views): what `git add` records keeps old's format
                fd.new_format = old.format
                if fd.groups:
                    fd.notes.append(f"the work tree holds a {new.format} view; git add records {old.format}")
        finally:
            for side in (old, new):
                if isinstance(side, CheckpointSide):
                    side.close()
        if fd.groups or fd.notes or fd.old_format is None or fd.new_format is None:
            yield fd


def diff_command(revs: list[str], paths: list[str], estimate: bool = False, stat: bool = False,
                 out: TextIO | None = None, color: bool | None = None, cwd: str | os.PathLike = ".",
                 as_json: bool = False) -> int:
    """Print the model diff of the theta-tracked paths; returns how many files differ.

    No revision: the index against the working tree; one: that revision against the working tree; two: the
    two revisions. ``as_json``: one JSON document (see :func:`file_diff_json`) instead of the report.
    """
    if as_json:
        docs = [file_diff_json(fd) for fd in file_diffs(revs, paths, estimate, cwd)]
        (out or sys.stdout).write(json.dumps(jsonable({"revs": revs, "files": docs}), indent=1,
                                             ensure_ascii=False, allow_nan=False) + "\n")
        return len(docs)
    console = make_console(out, color)
    count = 0
    for fd in file_diffs(revs, paths, estimate, cwd):
        render(fd, console, stat=stat)
        count += 1
    return count


def file_diff_json(fd: FileDiff) -> dict:
    """A file's model diff as JSON-able data: per group status, dtype/shape/update on each side, statistics."""
    def side(i: GroupInfo | None):
        return None if i is None else {"dtype": i.dtype, "shape": list(i.shape), "update": i.update,
                                       "chain": i.chain}

    groups = []
    for g in fd.groups:
        doc = {"name": g.name, "status": g.status, "old": side(g.old), "new": side(g.new)}
        if g.stats is not None:
            s = g.stats
            doc["stats"] = {"numel": s.numel, "changed": s.changed, "l2": s.l2, "relative": s.relative,
                            "max_abs": s.max_abs, "old_l2": s.old_l2}
        if g.estimate is not None:
            doc["estimate_l2"] = g.estimate
        groups.append(doc)
    counts = {s: fd.count(s) for s in ("modified", "added", "removed", "reshaped", "retyped")}
    counts["unchanged"] = fd.unchanged
    return {"path": fd.path, "old_format": fd.old_format, "new_format": fd.new_format, "estimated": fd.estimated,
            "notes": fd.notes, "counts": counts, "groups": groups}


# ---------- textconv: a line per group, for `git log -p` / `git show` without --ext-diff ----------------------

def textconv_lines(file: str) -> list[str]:
    """One line per tensor (name, dtype, shape, content hash); git diffs these lines like text.

    Only metadata is read for metadata files; a checkpoint (the working-tree side) is hashed group by group
    and each value named as `git add` would name it (:func:`_named_as_clean`), so an unchanged group reads
    the same on both sides of the diff.
    """
    side = side_from_file(file, file, ".")
    if side is None:
        return []
    if isinstance(side, OpaqueSide):
        return [f"opaque file (not a checkpoint): {side.ref.size} bytes, sha256 {side.ref.oid}"]
    try:
        committed = _committed_names(file) if isinstance(side, CheckpointSide) else {}
        lines = [f"theta checkpoint ({side.format})"]
        for name in side.names():
            i = side.info(name)
            value = _named_as_clean(side, name, committed.get(name))
            lines.append(f"{name}  {_shape(i)}  {valuehash.label(value)[:23]}")
        for alias in sorted(side.aliases()):
            lines.append(f"{alias}  (tied to {side.meta.aliases[alias].of})")  # type: ignore[attr-defined]
        return lines
    finally:
        if isinstance(side, CheckpointSide):
            side.close()


def _committed_names(file: str) -> dict[str, str]:
    """The value names the index (else HEAD) records for ``file`` when it is a tracked file of the work tree
    git runs us in (the side of `git diff` that is not a blob git wrote to a temp file), else {}."""
    try:
        top = os.path.realpath(gitutil.toplevel("."))
    except ThetaError:
        return {}
    rel = os.path.relpath(os.path.realpath(file), top)
    if rel.startswith(os.pardir) or rel.split(os.sep, 1)[0] == ".git":
        return {}
    try:
        meta = committed_meta(Path(rel).as_posix(), top)
    except MetadataError:
        return {}
    return {} if meta is None else {n: g.hash for n, g in meta.groups.items()}


def _named_as_clean(side: CheckpointSide, name: str, committed: str | None) -> str:
    """``name``'s value as clean names it: its committed name while the value is unchanged (a sha256 one
    included), else a BLAKE3 name (:mod:`theta.base.valuehash`)."""
    if committed is not None and not valuehash.is_blake3(committed) and side.hash(name, like=committed) == committed:
        return committed
    return side.hash(name)


def textconv_main(file: str, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        out.write("\n".join(textconv_lines(file)) + "\n")
    except ThetaError as e:
        sys.stderr.write(f"theta diff-textconv: {file}: {e}\n")
        return 1
    return 0
