"""Placeholders and their materialization: how a checkpoint bigger than git can hold reaches the work tree.

git reads a smudge filter's whole output into memory before it writes the work-tree file, so handing git an
N GiB checkpoint costs git N GiB. For a large checkpoint the filter therefore answers git with a
*placeholder*: the checkpoint's metadata text itself (what git stores; it starts with ``theta-metadata``).
git writes that small file and records it in the index. When the git command has finished, theta replaces
each placeholder with the real checkpoint (:func:`materialize`):

1. the placeholder must still be what git wrote, and the index must still name its blob (nothing else ran);
2. the blobs of every file are fetched in one git-lfs run;
3. each checkpoint is rebuilt group by group into a temp file on the same file system (under
   ``<git-dir>/theta/``), then renamed over the placeholder: a reader, a crash or kill -9 sees either the
   placeholder or the whole checkpoint, never part of one;
4. the index records the new file's stat data (:func:`theta.git.index.record_stat`), as git records a file
   it wrote itself: `git status` is clean and never re-reads the checkpoint.

Who calls it: the filter process, on the end of git's request stream -- git closes the filter's stdin when
it exits and waits for the filter to stop (gitattributes(5), "Long Running Filter Process"), so this runs
after every git command that checked files out (checkout, switch, restore, merge, pull, reset, stash,
rebase, cherry-pick, clone...), with git's index written and unlocked, before the command returns. And
`git theta checkout` / `git theta pull`, for placeholders left by a clone made without theta, by
GIT_THETA_SKIP_SMUDGE, or by a materialization that could not complete (no network, disk full).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from theta import settings
from theta.base.errors import IndexBusyError, IndexUnsupportedError, MetadataError, ThetaError, TransferError
from theta.commands.filter import handoff
from theta.commands.filter.watchdog import Watchdog
from theta.git import index as gitindex
from theta.git import repo as gitutil

# The numpy-dependent layers are imported inside the functions that use them: `git theta checkout` and the
# hooks import this module on every checkout, and numpy's import (~0.3 s) is only worth paying when there is a
# placeholder to write (tests/cli/test_startup_imports.py).

HEADER = b"theta-metadata "
KILLED = "the process writing it was killed before it finished"  # what a record says until the file is done
MAX_PLACEHOLDER_BYTES = 256 << 20  # a work-tree file larger than this is never a placeholder: not read whole


@dataclass(frozen=True)
class Placeholder:
    """A work-tree file holding a checkpoint's metadata text instead of the checkpoint."""

    path: str      # as git names it: relative to the work-tree root, "/"-separated
    text: bytes    # the metadata: what git stores, and what the work-tree file holds
    oid: str       # git's blob id of ``text``
    # when the filter handed it to git (time.time_ns()); None for one found in the work tree
    issued_ns: int | None = None
    meta: object = field(default=None, compare=False, repr=False)  # ``text`` parsed, when the caller has it


# file timestamps come from the kernel's coarse clock, a few ms behind time.time_ns()
_CLOCK_SLACK_NS = 100_000_000


@dataclass
class Outcome:
    """What :func:`materialize` did: files now holding their checkpoint, and files left as placeholders."""

    done: list[str] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C: the files not done yet are left as placeholders

    def left_lines(self) -> list[str]:
        """One line per file left as a placeholder, naming it and the command that finishes the job."""
        return [f"{path} is a placeholder ({why}); run `git theta checkout {_quote(path)}`"
                for path, why in self.left]


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path)


def data_bytes(meta) -> int:
    """Bytes of tensor data a checkpoint holds (about its file size)."""
    from zipslice import dtypes

    return sum(g.numel * dtypes.get(g.dtype).itemsize for g in meta.groups.values())


def is_placeholder_file(path: str | os.PathLike) -> bool:
    """True when the file starts like theta metadata (cheap: reads 15 bytes)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(HEADER)) == HEADER
    except OSError:
        return False


# -- finding placeholders ------------------------------------------------------------------------------
def find_placeholders(root: Path, pathspecs: list[str] | None = None, spec_cwd=None
                      ) -> tuple[list[Placeholder], list[tuple[str, str]]]:
    """Placeholders among the theta-tracked files of the index (restricted to ``pathspecs``, read relative
    to ``spec_cwd`` as git reads them), and the (path, why) of tracked files that hold metadata other than
    the index's (left alone).

    A file is a placeholder when it starts with ``theta-metadata`` and its bytes are exactly the blob the
    index records for it: materializing it is then what `git checkout` would have written.
    """
    names = gitutil.run(["ls-files", "-z", "--full-name", "--", *(pathspecs or [])], spec_cwd or root).decode(
        "utf-8", "surrogateescape").split("\0")
    names = sorted({n for n in names if n})
    if not names:
        return [], []
    attrs = gitutil.check_attr("filter", names, root)
    tracked = [n for n in names if attrs.get(n) == "theta" and is_placeholder_file(root / n)]
    if not tracked:
        return [], []
    entries = _index_entries(root, set(tracked))
    hash_name = gitutil.object_format(root)
    found, other = [], []
    for name in tracked:
        text = _read_small(root / name)
        if text is None:
            continue
        oid = gitutil.blob_id(text, hash_name)
        if oid in entries.get(name, ()):
            found.append(Placeholder(name, text, oid))
        else:
            other.append((name, "holds theta metadata that is not the index's version of the file"))
    return found, other


def _read_small(path: Path) -> bytes | None:
    try:
        if path.stat().st_size > MAX_PLACEHOLDER_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def _index_entries(root: Path, paths: set[str]) -> dict[str, set[str]]:
    """path -> blob ids the index holds for it (all stages), for ``paths``."""
    index_file = gitutil.git_path("index", root)
    try:
        data = index_file.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        _, entries = gitindex.parse(data, gitutil.object_format(root))
    except IndexUnsupportedError:  # e.g. a split index: ask git
        out: dict[str, set[str]] = {}
        listing = gitutil.run(["ls-files", "-z", "--stage", "--full-name"], root).decode("utf-8", "surrogateescape")
        for item in listing.split("\0"):
            if item:
                meta, _, name = item.partition("\t")
                if name in paths:
                    out.setdefault(name, set()).add(meta.split()[1])
        return out
    out = {}
    for e in entries:
        if e.path in paths:
            out.setdefault(e.path, set()).add(e.oid)
    return out


def _stage0_entries(root: Path, paths: set[str], hash_name: str) -> dict[str, str]:
    """path -> the blob id of its stage-0 index entry, for ``paths``; empty for an index theta does not
    edit (nothing is then dated back: git refreshes such an index by reading the files)."""
    try:
        _, entries = gitindex.parse(gitutil.git_path("index", root).read_bytes(), hash_name)
    except (OSError, IndexUnsupportedError):
        return {}
    return {e.path: e.oid for e in entries if e.stage == 0 and e.path in paths}


# -- materializing -------------------------------------------------------------------------------------
def materialize(root: str | os.PathLike, placeholders: list[Placeholder], progress: bool | None = None,
                remote: str | None = None, store=None, verify: str | None = None,
                hash_name: str | None = None) -> Outcome:
    """Replace each placeholder with its checkpoint, atomically, then record in the index the files whose
    index entry is the placeholder's blob (a file restored from another commit stays modified, as in git).

    Memory stays bounded by two parameter groups whatever the checkpoint's size. Never raises for one file's
    problem: it is reported in ``Outcome.left`` and that file stays a placeholder (git status clean).
    ``store``, ``verify`` (theta.verify) and ``hash_name`` (the object format): what the caller already
    knows, else read here.
    """
    from theta.storage.metadata import loads
    from theta.storage.store import LfsStore

    root = Path(root).resolve()
    out = Outcome()
    if not placeholders:
        return out
    progress = settings.stderr_is_terminal() if progress is None else progress
    hash_name = hash_name or gitutil.object_format(root)
    todo = []
    for p in placeholders:
        target = root / p.path
        try:
            before = os.stat(target)
            if before.st_size != len(p.text) or target.read_bytes() != p.text:
                continue  # not (or no longer) the placeholder: git wrote something else there
            if p.issued_ns is not None and before.st_mtime_ns < p.issued_ns - _CLOCK_SLACK_NS:
                continue  # a placeholder that was there before git smudged this blob for another purpose
            meta = p.meta if p.meta is not None else loads(p.text)
        except FileNotFoundError:
            continue
        except (OSError, MetadataError) as e:
            out.left.append((p.path, str(e)))
            continue
        todo.append((p, meta, before))
    if not todo:
        return out
    store = store or LfsStore.for_repo(root)
    updates: dict[str, tuple[str, os.stat_result]] = {}
    work = _work_dir(root)
    pending = [p.path for p, _, _ in todo]
    oids = {p.path: p.oid for p, _, _ in todo}
    # recorded before the first byte: a process killed meanwhile leaves the record (theta.commands.filter.handoff),
    # and the watchdog says so on stderr
    handoff.note(root, {path: (oids[path], KILLED) for path in pending})
    dog = Watchdog([(path, f"git theta checkout {_quote(path)}") for path in pending], [str(work)],
                   str(handoff.record_path(root)))
    # only a file the index will record may be dated back (see _settle); any other keeps its real mtime
    held = _stage0_entries(root, set(pending), hash_name)
    settled = set()
    try:
        _write_all(root, work, store, todo, out, dog, remote, progress, verify, held, updates, settled)
        why = dict(out.left)
        handoff.note(root, {path: (oid, why[path]) if path in why else None for path, oid in oids.items()})
        recorded = _record(root, updates, hash_name, out, dog.locked)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dog.close()
    for path in settled - recorded:  # git changed the index meanwhile: undo the dating back (see _settle)
        try:
            os.utime(root / path)
        except OSError:
            pass
    return out


def _write_all(root: Path, work: Path, store, todo, out: Outcome, dog: Watchdog, remote, progress: bool, verify,
               held: dict, updates: dict, settled: set) -> None:
    """Write each file of ``todo`` as its blobs arrive (see :func:`materialize`): ``updates`` gets each written
    file's (blob, stat), ``settled`` those dated back, ``out`` what is done and left; Ctrl-C leaves the rest."""
    pending = [p.path for p, _, _ in todo]
    try:
        verify = verify or settings.verify_mode(root)
        formats = settings.checkout_formats([p.path for p, _, _ in todo], root) if todo else {}
        with _fetching(root, store, todo, out, remote, progress) as arrived:
            for p, meta, before in todo:
                settle = held.get(p.path) == p.oid
                try:
                    st = _write_one(root, work, p, meta, arrived, before, verify, progress, settle,
                                    formats[p.path])
                except (ThetaError, OSError) as e:
                    out.left.append((p.path, _one_line(e)))
                else:
                    if st is not None:
                        updates[p.path] = (p.oid, st)
                        out.done.append(p.path)
                        if settle:
                            settled.add(p.path)
                pending.remove(p.path)
                dog.done(p.path)
    except KeyboardInterrupt:  # Ctrl-C: temp files go, what is done stays done and is recorded
        out.left.extend((path, "interrupted") for path in pending)
        out.interrupted = True
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _fetching(root: Path, store, todo, out: Outcome, remote: str | None, progress: bool):
    """The store the files are rebuilt from: while one git-lfs run downloads every missing blob of every file
    in the background, in the order the files and their groups are rebuilt, reads wait for them
    (theta.storage.transfer.arriving), so a checkpoint is written as its blobs arrive. A file whose blobs do not
    all arrive fails alone, naming the blob and git-lfs's reason."""
    from theta.storage.transfer import arriving

    refs = [r for _, meta, _ in todo for r in _in_file_order(meta)]
    names = [p.path for p, _, _ in todo]
    label = f"theta fetch {names[0]}" + (f" (+{len(names) - 1} files)" if len(names) > 1 else "") if names else ""
    with ExitStack() as stack:
        try:
            arrived = stack.enter_context(arriving(root, refs, remote=remote, store=store,
                                                   progress=label if progress else None))
        except TransferError as e:  # nothing to fetch from: every file whose blobs are missing stays
            out.notes.append(str(e))
            arrived = store
        yield arrived


def _in_file_order(meta) -> list:
    """The blobs of a checkpoint in the order a checkout reads them: group by group as the file lists them,
    each group's chain from its first step."""
    if meta.is_opaque:
        return meta.blob_refs()
    try:
        groups = [meta.group_for(n) for n in meta.order] + [meta.groups[n] for n in sorted(meta.groups)]
    except MetadataError:  # (the rebuild refuses such metadata, naming the problem)
        return meta.blob_refs()
    seen, refs = set(), []
    for g in groups:
        for step in g.steps:
            if step.blob not in seen:
                seen.add(step.blob)
                refs.append(step.blob)
    return refs


def _work_dir(root: Path) -> Path:
    """A private directory for temp files on the work tree's file system, under <git-dir>/theta; temp
    directories left by a killed process are removed first."""
    base = gitutil.theta_dir(root)
    for d in base.glob("materialize-*"):
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
    work = base / f"materialize-{os.getpid()}"
    work.mkdir(exist_ok=True)
    return work


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_one(root: Path, work: Path, p: Placeholder, meta, store, before: os.stat_result, verify: str,
               progress: bool, settle: bool, checkout_format) -> os.stat_result | None:
    """Rebuild one checkpoint and rename it over its placeholder; its stat data, or None if the placeholder
    changed meanwhile (then nothing is replaced). ``settle``: date it back (see :func:`_settle`);
    ``checkout_format()``: the format to write (settings.checkout_formats)."""
    target = root / p.path
    # same file system as the target: the final rename is atomic (else a temp file beside the target)
    tmp_dir = work if os.stat(work).st_dev == before.st_dev else target.parent
    tmp = tmp_dir / f".{target.name}.theta-{os.getpid()}.new"  # smudge_checkpoint uses ...tmp beside it
    fmt = checkout_format()
    try:
        _build(meta, store, tmp, target.name, fmt, verify, progress, p.path)
        mode = 0o777 if before.st_mode & 0o100 else 0o666
        os.chmod(tmp, mode & ~_umask())
        if not _publish(tmp, target, before):
            return None  # someone changed the placeholder while we wrote: theirs wins
    finally:
        if tmp.exists():
            tmp.unlink()
    if settle:
        _settle(target)
    return os.stat(target)


def _build(meta, store, tmp: Path, name: str, fmt: str | None, verify: str, progress: bool, path: str) -> None:
    """The checkpoint of ``meta`` written into ``tmp`` (in format ``fmt``; ``name``: the file's real name)."""
    from zipslice.fileio import WriteBehindFile

    from theta.model.smudge import smudge_checkpoint, smudge_to_stream, streams

    if streams(meta, fmt, path):
        # written straight into the temp file (no second temp file, no fsync: git does not fsync the
        # work tree either; a kill leaves the placeholder, the exchange publishes the whole file)
        with open(tmp, "wb") as f:  # its dirty pages bounded, as zipslice's writers keep theirs
            smudge_to_stream(meta, store, WriteBehindFile(f), name, fmt=fmt, progress=progress, verify=verify)
    else:
        smudge_checkpoint(meta, store, tmp, fmt=fmt, progress=progress, verify=verify, name=name)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_ino, b.st_size, b.st_mtime_ns)


def _publish(tmp: Path, target: Path, before: os.stat_result) -> bool:
    """Put the finished file ``tmp`` in the place of the placeholder ``target`` (as it was: ``before``), in one
    step; False, with ``target`` left as it is, when the placeholder changed meanwhile.

    The two names are swapped (:func:`theta.base.scratch.exchange`: no writeback of the checkpoint inside the
    rename), so what was replaced can be checked afterwards: when it is not the placeholder (a write that raced
    the swap) it is swapped back. Where the system cannot swap, the placeholder is checked, then renamed over.
    A kill at any point leaves ``target`` holding the placeholder or the whole checkpoint, and the temp name
    (under this process's work directory, swept by the next run) holding the other or nothing.
    """
    from theta.base import faults, scratch

    if not _same_file(os.stat(target), before):
        return False
    if not scratch.exchange(tmp, target):
        os.replace(tmp, target)
        return True
    faults.point("materialize:swapped")
    if not _same_file(os.lstat(tmp), before):  # changed between the check and the swap: theirs wins
        scratch.exchange(tmp, target)
        return False
    os.unlink(tmp)  # the placeholder
    return True


def _settle(path: Path) -> None:
    """Date the file one second back when it was written in the current second.

    git distrusts an entry whose mtime is not older than the index file ("racily clean") and re-reads the
    file on each `git status` until the index is rewritten a second later. The index is rewritten right
    now, so a checkpoint just written would be re-read -- gigabytes -- by the next `git status`.

    Only for a file whose new stat data the index records: git compares whole seconds, size and inode, so
    a file dated back but left unrecorded (`git restore --source`) could match the entry of the file it
    replaced (same size, reused inode, same second) and look unmodified.
    """
    st = os.stat(path)
    second = time.time_ns() // 1_000_000_000
    if st.st_mtime_ns // 1_000_000_000 >= second:
        os.utime(path, ns=(st.st_atime_ns, (second - 1) * 1_000_000_000 + st.st_mtime_ns % 1_000_000_000))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _record(root: Path, updates: dict, hash_name: str, out: Outcome, locked=None) -> set[str]:
    """Record the materialized files' stat data in the index (git status then trusts them unread); the
    paths recorded. ``locked``: told when index.lock is held (gitindex.record_stat)."""
    if not updates:
        return set()
    index_file = gitutil.git_path("index", root)
    try:
        return set(gitindex.record_stat(index_file, updates, hash_name, locked))
    except FileNotFoundError:
        return set()  # a temporary index (GIT_INDEX_FILE) that git already removed
    except IndexBusyError as e:
        out.notes.append(f"{e}; `git status` will re-read {', '.join(sorted(updates))} once")
        return set()
    except IndexUnsupportedError:
        pass
    except OSError as e:
        out.notes.append(f"could not update {index_file}: {e}")
        return set()
    # an index theta does not edit (split index): git refreshes it, reading each file once
    gitutil.run_status(["update-index", "-q", "--refresh", "--", *sorted(updates)], root)
    return set()


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)


def report(out: Outcome, stream=None) -> None:
    """Print the outcome's notes and one line per placeholder left, on stderr."""
    stream = stream or sys.stderr
    for line in out.notes + out.left_lines():
        print(f"git-theta: {line}", file=stream, flush=True)
