"""Commit a model from Python without writing the checkpoint file: Git-Theta's in-process API, theta's way.

    sha = theta.save_to_git(model.state_dict(), "model.pt", "after epoch 3", tag="epoch-3")
    weights = theta.load_from_git("epoch-3", "model.pt")       # a lazy mapping: theta.load(path, rev=...)

:func:`save_to_git` records a state dict as the new version of a tracked path and commits it, group by group,
exactly as ``git add`` + ``git commit`` would record the file ``torch.save`` writes (:mod:`theta.model.statedict`):
the same change detection against the committed version, the same update policy (``theta.updateType`` and
the other clean settings), blobs into the same store, memory bounded as a clean is (a group above
:data:`theta.model.framewise.STREAM_BYTES` is read frame by frame). Only the metadata text becomes a git object.

What it does to the repository (see docs/reference/theta-api.md):

- the commit holds HEAD's tree with only PATH replaced (and ``.gitattributes`` when PATH was not tracked yet):
  whatever else is staged stays staged and out of it. No hook runs (as for any plumbing commit);
  ``commit.gpgSign`` is honoured. HEAD moves only if nobody moved it meanwhile.
- the index records PATH's new version, so ``git diff --cached`` says nothing about PATH;
- the work-tree file is left as it was: absent (``git status`` lists PATH as deleted) or an older version
  (listed as modified) -- the work tree really does not hold the committed version. ``checkout=True``, or
  ``git theta checkout PATH`` / ``git checkout -- PATH`` later, writes it. A work-tree file that was a
  placeholder of the previous version (its metadata text) is replaced by the new version's placeholder.

Refused, before anything is stored (each a :class:`~theta.base.errors.ThetaError` naming the path): a path outside a
git work tree, a path another filter tracks or that git already holds untracked by theta, a path with staged
changes or a merge conflict, a merge/rebase/cherry-pick in progress, an existing or invalid tag, a state dict
the format cannot hold.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zipslice
from zipslice.base import LazyCheckpoint

from theta import settings
from theta.model.clean import CleanStats, clean_checkpoint
from theta.commands.hooks import ensure_installed_quietly
from theta.commands.filter.materialize import MAX_PLACEHOLDER_BYTES, Placeholder, materialize
from theta.commands.track import parse_line, track_lines
from theta.base.errors import (CheckpointError, GitError, IndexBusyError, IndexUnsupportedError, NotARepositoryError,
                          StagedChangesError, ThetaError, TrackError)
from theta.git import commit as gitcommit
from theta.git import index as gitindex
from theta.git import repo as gitutil
from theta.peers.gittheta.files import committed as git_theta_committed
from theta.peers.gittheta.files import is_git_theta, to_theta_metadata
from theta.peers.gittheta.lazy import open_version as open_git_theta_version
from theta.model.lazy import load
from theta.model.statedict import StateDictCheckpoint
from theta.storage.committed import committed_meta, committed_text
from theta.storage.metadata import dumps, same_content
from theta.storage.store import LfsStore
from theta.model.views import committed_form

# Git-Theta's checkpoint types (its plugin names) and theta's format names -> the format recorded
CHECKPOINT_TYPES = {"pytorch": "torch", "pickled-dict": "torch", "torch": "torch",
                    "safetensors": "safetensors", "safetensors-checkpoint": "safetensors", "hdf5": "hdf5"}
_GLOB = set("*?[]\\!#\"") | set(" \t\r\n")  # characters that make a path a gitattributes pattern of something else


class CommitId(str):
    """A commit id (a ``str``); ``.hexsha`` gives it too, as Git-Theta's GitPython commit object did."""

    @property
    def hexsha(self) -> str:
        return str(self)


@dataclass
class Saved:
    """What :func:`commit_checkpoint` did."""

    commit: CommitId
    path: str                      # relative to the top of the work tree
    format: str                    # the format PATH is recorded in
    text_bytes: int                # size of the metadata text git stores
    tracked: bool = False          # PATH was tracked by this save (.gitattributes changed in the commit)
    stats: CleanStats = field(default_factory=CleanStats)
    worktree: str = "left"         # "left" as it was, "placeholder" updated, "checked-out"


def save_to_git(state_dict, path: str, commit_msg: str, tag: str | None = None,
                checkpoint_type: str | None = None, checkout: bool = False) -> CommitId:
    """Commit ``state_dict`` as the new version of ``path`` without writing the checkpoint file.

    ``state_dict``: a mapping of names to torch tensors or numpy arrays (nested containers and plain values
    as torch.save allows), or a lazy checkpoint (:func:`zipslice.load`, :func:`theta.load`). ``path``: the
    file it is the version of, relative to the current directory (or absolute), inside a git work tree; a
    path not tracked yet is tracked as `git theta track PATH` would. ``tag``: a lightweight tag on the new
    commit. ``checkpoint_type``: the format to record (Git-Theta's names ``pytorch``, ``safetensors``, or
    ``torch``/``safetensors``/``hdf5``); default: PATH's committed format, else its extension's.
    ``checkout``: also write the checkpoint into the work tree (its previous content must be the committed
    version). Returns the new commit's id.
    """
    return commit_checkpoint(state_dict, path, commit_msg, tag=tag, fmt=checkpoint_type, checkout=checkout).commit


def load_from_git(sha_or_tag, path: str, checkpoint_type: str | None = None, checkout: bool = False):
    """The version of ``path`` committed at ``sha_or_tag`` (any revision; a Git-Theta commit object works), as a
    lazy mapping of names to torch tensors (:func:`theta.load`): each group is rebuilt when it is read, and
    ``torch.save(result, f)`` saves the state dict itself. A version Git-Theta committed is read as Git-Theta
    checks it out. ``checkpoint_type`` is checked but changes nothing (the tensors are the same whatever the
    committed format). ``checkout``: also check out that revision (``git checkout REV``, as Git-Theta does).
    """
    rev = str(getattr(sha_or_tag, "hexsha", sha_or_tag))
    if checkpoint_type is not None:
        _format_of(checkpoint_type)
    top, rel, _ = _locate(path, None)
    spec = f"{rev}:{rel}"
    data = gitutil.read_blob(spec, top)
    if is_git_theta(data):  # a version Git-Theta committed: read as Git-Theta checks it out
        lsd = open_git_theta_version(data, spec, rel, top, LfsStore.for_repo(top))
    else:
        lsd = load(path, rev=rev)
    if checkout:
        gitutil.run(["checkout", "--quiet", rev], top)
    return lsd


def commit_checkpoint(state_dict, path: str | os.PathLike, message: str, *, tag: str | None = None,
                      fmt: str | None = None, checkout: bool = False, cwd: str | os.PathLike | None = None,
                      progress: bool | None = None) -> Saved:
    """:func:`save_to_git` with its details: ``fmt`` as ``checkpoint_type``; ``cwd`` the directory ``path`` is
    relative to (default: the current one); ``progress`` a bar on stderr (default: when it is a terminal)."""
    if not isinstance(message, str):
        raise ThetaError(f"the commit message must be a str, got {type(message).__name__}")
    top, rel, full = _locate(path, cwd)
    explicit = _format_of(fmt) if fmt is not None else None
    if tag is not None:
        gitcommit.check_new_tag(top, tag)
    head, mode = _check_state(top, rel)
    if isinstance(state_dict, LazyCheckpoint):
        source, own = _Borrowed(state_dict), state_dict.format
    elif isinstance(state_dict, Mapping):
        source, own = StateDictCheckpoint(state_dict, rel), "torch"  # (checked here: before anything is stored)
    else:
        raise CheckpointError(f"{rel}: a state dict must be a mapping of names to tensors or a lazy "
                              f"checkpoint, got a {type(state_dict).__name__}")
    if checkout and full.exists() and not _placeholder_of_previous(full, top, rel) \
            and gitutil.run_status(["diff", "--quiet", "--", rel], top) != 0:
        raise ThetaError(f"{rel} has changes in the work tree that checkout=True would overwrite; commit or "
                         f"move them first")

    store = LfsStore.for_repo(top)
    # (a directory of this call's own: two threads may save at once; the second then finds HEAD moved)
    with tempfile.TemporaryDirectory(prefix="save-", dir=gitutil.scratch_dir(top)) as scratch:
        attributes = _attributes_edit(top, rel, head, scratch) if _filter_of(top, rel) != "theta" else None
        previous_text, previous = _previous(top, rel, store, scratch)
        target = explicit
        if target is None and previous is None:
            target = _format_of_extension(rel) or (own if own in CHECKPOINT_TYPES.values() else "torch")
        options = settings.clean_options(top, progress=settings.stderr_is_terminal() if progress is None else progress)
        stats = CleanStats()
        view = clean_checkpoint(rel, store, previous, options, stats=stats, opener=lambda _: source)
        meta = committed_form(view, previous, target, rel)
        text = dumps(meta, file=rel).encode("utf-8")
        if previous_text is not None and previous_text != text and same_content(previous_text, text):
            text = previous_text  # the same checkpoint committed by an older theta: keep its bytes
        entries = {rel: (mode, gitcommit.write_blob(top, text))}
        if attributes is not None:
            entries[".gitattributes"] = attributes.entry(top)

        ensure_installed_quietly(top)  # theta's pre-push hook uploads the new blobs with the commit
        commit = CommitId(gitcommit.commit_entries(top, entries, message, head, scratch))
        saved = Saved(commit, rel, meta.format, len(text), tracked=attributes is not None, stats=stats)
        try:
            gitcommit.stage_entries(top, entries)
        except GitError as e:
            raise GitError(f"committed {rel} as {commit}, but the index could not be updated ({e}); run "
                           f"`git reset -q -- {' '.join(entries)}` to make it match HEAD") from None
        if attributes is not None:
            attributes.publish(top)
        if tag is not None:
            try:
                gitcommit.create_tag(top, tag, commit)
            except GitError as e:
                raise GitError(f"committed {rel} as {commit}, but could not tag it {tag!r}: {e}") from None
        saved.worktree = _update_work_tree(top, rel, full, previous_text, text, entries[rel][1], meta, store,
                                           checkout, progress)
        return saved


def preflight(path: str | os.PathLike, cwd: str | os.PathLike | None = None) -> str:
    """Raise what :func:`commit_checkpoint` would refuse about ``path`` and the repository (before any training
    step is spent); returns ``path`` relative to the top of its work tree. Nothing is written."""
    top, rel, _ = _locate(path, cwd)
    head, _ = _check_state(top, rel)
    if _filter_of(top, rel) != "theta":
        with tempfile.TemporaryDirectory(prefix="preflight-", dir=gitutil.scratch_dir(top)) as scratch:
            _attributes_edit(top, rel, head, Path(scratch))
    return rel


# -- checks --------------------------------------------------------------------------------------------------
def _locate(path: str | os.PathLike, cwd: str | os.PathLike | None) -> tuple[Path, str, Path]:
    """(top of the work tree, ``path`` relative to it in git's form, ``path`` absolute)."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    full = Path(os.path.abspath(base / path))
    top = _work_tree(full)
    return top, _relative(full, top, path), full


def _check_state(top: Path, rel: str) -> tuple[str | None, str]:
    """(HEAD's commit or None, the mode to record ``rel`` with), after refusing a repository in the middle of
    an operation and a path a commit from Python must not touch."""
    busy = gitcommit.operation_in_progress(top)
    if busy is not None:
        raise ThetaError(f"{rel}: {busy} is in progress; finish or abort it before committing from Python")
    head = gitcommit.head_commit(top)
    return head, _check_path(top, rel, head)


def _work_tree(path: str | os.PathLike) -> Path:
    """The top of the git work tree holding ``path`` (which need not exist)."""
    d = Path(os.path.abspath(path))
    d = d if d.is_dir() else d.parent
    while not d.is_dir():
        d = d.parent
    try:
        return Path(gitutil.toplevel(d)).resolve()
    except GitError:
        raise NotARepositoryError(f"{os.fspath(path)}: not inside a git work tree") from None


def _relative(full: Path, top: Path, given) -> str:
    try:  # (the directories resolved, not the file: a symlink in the work tree is a path of its own to git)
        rel = (Path(os.path.realpath(full.parent)) / full.name).relative_to(top).as_posix()
    except ValueError:
        raise ThetaError(f"{os.fspath(given)}: outside the work tree at {top}") from None
    if rel in ("", ".") or rel == ".git" or rel.startswith(".git/") or full.is_dir():
        raise ThetaError(f"{os.fspath(given)}: not a file path in the work tree at {top}")
    return rel


def _format_of(name: str) -> str:
    try:
        return CHECKPOINT_TYPES[name]
    except (KeyError, TypeError):
        raise ThetaError(f"checkpoint type {name!r} is not supported; one of: "
                         f"{', '.join(sorted(CHECKPOINT_TYPES))}") from None


def _format_of_extension(rel: str) -> str | None:
    try:
        fmt = zipslice.format_for_path(rel)
    except ValueError:
        return None
    return fmt if fmt in CHECKPOINT_TYPES.values() else None


def _filter_of(top: Path, rel: str) -> str | None:
    return gitutil.check_attr("filter", [rel], top).get(rel)


def _check_path(top: Path, rel: str, head: str | None) -> str:
    """The mode to record ``rel`` with, after refusing what a commit of it from Python must not touch."""
    in_head = gitcommit.tree_entry(top, head, rel)
    if in_head is not None and (in_head[1] != "blob" or in_head[0] not in (gitcommit.REGULAR, gitcommit.EXECUTABLE)):
        raise ThetaError(f"{rel} is a {'directory' if in_head[1] == 'tree' else in_head[1]} "
                         f"(mode {in_head[0]}) in HEAD, not a file")
    out = gitutil.run(["ls-files", "-z", "--full-name", "--", rel], top).decode("utf-8", "surrogateescape")
    if any(name.startswith(rel + "/") for name in out.split("\0")):
        raise ThetaError(f"{rel} is a directory in the index, not a file")
    stages = gitcommit.index_entries(top, rel)
    if any(e.stage for e in stages):
        raise StagedChangesError(f"{rel} has an unresolved merge conflict; resolve it (or `git checkout --ours "
                                 f"{rel}` + `git add`) before committing it from Python")
    staged = stages[0] if stages else None
    if (staged and (staged.mode, staged.oid)) != (in_head and (in_head[0], in_head[2])):
        raise StagedChangesError(f"{rel} has staged changes; commit them or unstage them "
                                 f"(`git restore --staged {rel}`) before committing it from Python")
    if _filter_of(top, rel) not in ("theta", None):
        raise TrackError(f"{rel} is tracked by filter={_filter_of(top, rel)}; untrack it from that tool "
                         f"(e.g. `git lfs untrack`) and `git theta track` it first")
    if _filter_of(top, rel) is None and in_head is not None:
        raise TrackError(f"{rel} is committed without theta; run `git theta track {rel}` and `git add {rel}` "
                         f"first (its next versions can then be committed from Python)")
    return in_head[0] if in_head is not None else gitcommit.REGULAR


@dataclass
class _AttributesEdit:
    """``.gitattributes`` with PATH tracked: its new text, committed with PATH and then written to the work tree."""

    path: Path
    text: bytes
    oid: str | None = None
    mode: str = gitcommit.REGULAR

    def entry(self, top: Path) -> tuple[str, str]:
        if self.oid is None:
            self.oid = gitcommit.write_blob(top, self.text)
        return self.mode, self.oid

    def publish(self, top: Path) -> None:
        """Write the new text to the work tree and record its stat data, so ``git status`` is clean for it."""
        tmp = self.path.with_name(".gitattributes.theta.tmp")
        tmp.write_bytes(self.text)
        tmp.replace(self.path)
        try:
            gitindex.record_stat(gitutil.git_path("index", top), {".gitattributes": (self.oid, os.stat(self.path))},
                                 gitutil.object_format(top))
        except (IndexBusyError, IndexUnsupportedError, OSError):
            pass  # git re-reads the small file next time it looks


def _attributes_edit(top: Path, rel: str, head: str | None, scratch: Path) -> _AttributesEdit:
    """How to track ``rel``: refused when ``.gitattributes`` has changes of the user's (staged or not), when
    ``rel`` cannot be written as a pattern of itself alone, or when another attributes file would override it."""
    if any(c in _GLOB for c in rel) or rel.startswith("/"):
        raise TrackError(f"{rel} is not tracked by theta, and its name is not a plain pattern; run "
                         f"`git theta track PATTERN` with a pattern matching it first")
    attributes = top / ".gitattributes"
    if gitutil.run_status(["diff", "--quiet", "HEAD" if head else "--cached", "--", ".gitattributes"], top) != 0 \
            or (head is None and gitcommit.index_entries(top, ".gitattributes")):
        raise TrackError(f"{rel} is not tracked by theta and .gitattributes has changes of yours; commit them or "
                         f"run `git theta track {rel}` and commit .gitattributes first")
    text = attributes.read_text() if attributes.exists() else ""
    lines, _ = track_lines([parse_line(r) for r in text.splitlines()], rel)
    edit = _AttributesEdit(attributes, "".join(line.render() + "\n" for line in lines).encode("utf-8"))
    in_head = gitcommit.tree_entry(top, head, ".gitattributes")
    if in_head is not None:
        edit.mode = in_head[0]
    if gitcommit.attribute_with(top, rel, "filter", {".gitattributes": edit.entry(top)}, scratch) != "theta":
        raise TrackError(f"{rel}: a .gitattributes line tracking it would be overridden (by a subdirectory's "
                         f".gitattributes or .git/info/attributes); track it there with `git theta track`")
    return edit


def _previous(top: Path, rel: str, store, scratch: Path):
    """``(text, CheckpointMeta | None)``: PATH's committed metadata text (theta's, or Git-Theta's made theta's
    as the filter does), or ``(None, None)`` for a new path."""
    text = committed_text(rel, top)
    if text is not None:
        return text, committed_meta(rel, top)
    found = git_theta_committed(rel, top, store)
    if found is not None:
        _, gtf = found
        gtf.fetch()
        return None, to_theta_metadata(gtf, scratch)
    return None, None


# -- the work tree ----------------------------------------------------------------------------------------------
def _placeholder_of_previous(full: Path, top: Path, rel: str) -> bool:
    """Whether the work-tree file holds exactly the committed metadata text (a placeholder of that version)."""
    try:
        size = full.stat().st_size
    except OSError:
        return False
    if size > MAX_PLACEHOLDER_BYTES:
        return False
    text = committed_text(rel, top)
    return text is not None and size == len(text) and full.read_bytes() == text


def _update_work_tree(top: Path, rel: str, full: Path, previous_text: bytes | None, text: bytes, oid: str,
                      meta, store, checkout: bool, progress: bool | None) -> str:
    """Leave the work-tree file as it is, unless it was the previous version's placeholder (replaced by the new
    one's) or ``checkout`` (the checkpoint written, as a checkout writes it). Returns what was done."""
    placeholder = False
    try:
        if previous_text is not None and full.stat().st_size == len(previous_text):
            placeholder = full.read_bytes() == previous_text
    except OSError:
        pass
    if not (placeholder or checkout):
        return "left"
    _write_placeholder(top, rel, full, text, oid)
    if not checkout:
        return "placeholder"
    outcome = materialize(top, [Placeholder(rel, text, oid, meta=meta)], progress=progress, store=store)
    if outcome.left:
        raise ThetaError(f"committed {rel}, but could not write it to the work tree: "
                         + "; ".join(outcome.left_lines()))
    return "checked-out"


def _write_placeholder(top: Path, rel: str, full: Path, text: bytes, oid: str) -> None:
    """The metadata text at ``full`` (atomically), its stat data recorded in the index: a clean placeholder."""
    full.parent.mkdir(parents=True, exist_ok=True)
    tmp = full.with_name(f".{full.name}.theta.tmp")
    tmp.write_bytes(text)
    tmp.replace(full)
    try:
        gitindex.record_stat(gitutil.git_path("index", top), {rel: (oid, os.stat(full))}, gitutil.object_format(top))
    except (IndexBusyError, IndexUnsupportedError, OSError):
        pass  # git re-reads the small file next time it looks (the filter passes metadata through)


class _Borrowed:
    """A caller's lazy checkpoint handed to the clean, which closes what it opens: this one stays open."""

    def __init__(self, lsd):
        self._lsd = lsd

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lsd, name)

    def __iter__(self):
        return iter(self._lsd)

    def __len__(self) -> int:
        return len(self._lsd)

    def __contains__(self, key) -> bool:
        return key in self._lsd

    def __getitem__(self, key):
        return self._lsd[key]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
