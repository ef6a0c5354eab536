"""git's long-running filter process (gitattributes(5), "Long Running Filter Process"), protocol version 2.

One `git-theta filter-process` serves a whole `git add` / `git checkout`. stdout carries protocol data only;
messages go to stderr.

Clean (checkpoint -> metadata text). git sends the file's bytes; zipslice needs random access, so they must
end up in a file. Fast path: while receiving, the bytes are compared with the working-tree file at
``pathname``; if every byte matches (the normal `git add` case) that file is cleaned in place and nothing is
copied. At the first difference (or when there is no such file, e.g. `git hash-object --stdin`) the content
is spooled to a temporary file under ``<git-dir>/theta``. ``GIT_THETA_SPOOL=always`` forces spooling.
Content that already is theta metadata passes through unchanged. The metadata keeps the committed format
(that of the index, else HEAD) whatever format the work-tree file has: a file checked out in another format
is a view (theta.model.views); only `git theta add --format F` (env ``GIT_THETA_FORMAT``) changes the format.

Smudge (metadata text -> checkpoint): fetch all missing blobs of the file in one git-lfs run, then rebuild the
checkpoint group by group. A torch checkpoint streams to git while it is rebuilt (its writer never seeks);
other formats are written to a temporary file first, then sent. The output format is the committed
one unless the path has the attribute ``theta-format=<torch|safetensors|hdf5>`` or
``git config theta.checkoutFormat`` is set.

Any failure answers ``status=error``: before any content byte when it can (missing blobs, bad metadata),
else after the partial content, which the protocol allows and which makes git discard that content (a group
whose rebuilt value does not match its content hash is found while the next is written). Either way git
leaves the index and the working tree file untouched (``filter.theta.required=true`` makes git stop).
"""
from __future__ import annotations

import io
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import BinaryIO, Iterable

from theta.base import faults
from theta import settings
from theta.git import repo as gitutil
from theta.base.errors import CleanStopped, ProtocolError, ThetaError
from theta.git.pktline import PktReader, PktWriter, grow_pipe
from theta.commands.filter.receive import Received, receive
from theta.model.git_bytes import GroupHashes



# files git (or theta) reads from the repository itself: a `* filter=theta` pattern must not turn them into
# metadata, or a clone would read its attributes from a metadata text
GIT_OWN_FILES = frozenset({".gitattributes", ".gitignore", ".gitmodules", ".mailmap", ".thetamerge"})
# git commands whose clean requests carry the work-tree file's bytes (see Filter._clean_early)
ADDS_WORK_TREE = frozenset({"add", "commit", "stash", "status", "diff"})
# git commands whose smudged content goes somewhere other than the work tree (an archive, stdout)
CONTENT_WANTED = frozenset({"archive", "cat-file"})
# git commands that smudge only to give a diff program or theta's textconv a temp file: they get the metadata
# text, whatever the checkpoint's size, and theta reads it as it reads any committed version (from the store;
# a work-tree file is then named like its committed text). A user's own external diff still gets the checkpoint.
DIFFS_BLOBS = frozenset({"diff", "log", "show", "whatchanged", "blame", "annotate", "grep"})


def log(msg: str) -> None:
    print(f"git-theta: {msg}", file=sys.stderr, flush=True)


# -- receiving content ---------------------------------------------------------------------------------
# -- the two filters -------------------------------------------------------------------------------------
class _EarlyClean:
    """A clean of the work-tree file running on the "clean" thread while git's bytes arrive: its outcome is
    used when those bytes prove to be the file's (:func:`receive` compared every one), dropped otherwise."""

    def __init__(self, run, hashes: "GroupHashes | None" = None):
        import threading

        from theta.base import parallel

        self.t0 = time.perf_counter()
        self.stop = threading.Event()
        self.hashes = hashes

        def clean(stop):
            try:
                return run(stop)
            finally:
                if hashes is not None:
                    hashes.no_layout()  # (a clean that ended before laying out its groups)
        self.future = parallel.pool("clean").submit(clean, self.stop)

    def outcome(self):
        """What the clean returned (or raised)."""
        return self.future.result()

    def drop(self) -> None:
        """Stop it (before its next group) and wait until it has (its thread must not outlive the request)."""
        self.stop.set()
        self.future.cancel() or self.future.exception()


class Filter:
    """Clean and smudge for one repository (the process's working directory)."""

    def __init__(self, cwd: str | os.PathLike = "."):
        from theta.storage.store import LfsStore

        self.cwd = Path(cwd).resolve()
        self.store = LfsStore.for_repo(self.cwd)
        self.spool_dir = gitutil.scratch_dir(self.cwd)  # ours alone; what killed filters left is swept
        self.delayed: dict[str, bytes] = {}   # smudges set aside until list_available_blobs (path -> metadata)
        self.ready: dict[str, bytes] = {}     # delayed files whose blobs were fetched, awaiting git's request
        self.placeholders: dict = {}          # path -> Placeholder handed to git, materialized by finish()
        self._verify: str | None = None
        self._max_output: int | None = None
        self._checkout = None
        self._invoker: str | None = None  # the git subcommand that started this process, once asked
        self._hash: str | None = None     # the repository's object format, once asked
        self._diff: bool | None = None    # smudging for a diff (_for_a_diff), once asked

    def previous_text(self, path: str) -> bytes | None:
        """The metadata text of ``path`` in the index, else in HEAD (what clean may reuse), or None."""
        from theta.storage.committed import committed_text

        return committed_text(path, self.cwd)

    def previous(self, path: str, text: bytes | None = None):
        """The metadata of ``path`` in the index, else in HEAD (what clean may reuse), or None."""
        from theta.base.errors import MetadataError
        from theta.storage.metadata import loads

        data = text if text is not None else self.previous_text(path)
        if data is None:
            return None
        try:
            meta = loads(data, file=path)
        except MetadataError as e:
            log(f"warning: {path}: previous metadata unreadable ({e}); storing every group anew")
            return None
        return None if meta.is_opaque else meta

    def git_theta_committed(self, path: str):
        """``(text, GitThetaFile)`` when the index (else HEAD) holds Git-Theta metadata for ``path``, else None."""
        from theta.peers.gittheta.files import GitThetaFile, is_git_theta

        for spec in (f":{path}", f"HEAD:{path}"):
            data = gitutil.read_blob(spec, self.cwd)
            if data is not None:
                if not is_git_theta(data):
                    return None
                return data, GitThetaFile(data, path, self.cwd, self.store, label=spec)
        return None

    def clean(self, path: str, chunks: Iterable[bytes], forked=None) -> bytes:
        """The metadata to store for the work-tree content in ``chunks``, in the committed format: a file
        checked out in another format is a view of the committed one (theta.model.views).

        A file whose committed version Git-Theta wrote: if the content holds exactly the values that
        metadata checks out, the committed Git-Theta text is returned unchanged (``git status`` clean);
        otherwise it is stored in theta's format, building on the Git-Theta version as its previous one."""
        # (Git-Theta's modules are imported only when its files are met: 8 ms before the clean could start)
        from theta.storage.metadata import dumps, is_metadata, same_content

        worktree = self.cwd / path if path else None
        t_request = time.perf_counter()
        early = self._clean_early(path, worktree)
        try:
            hashes = early.hashes if early is not None else None
            if forked is not None:  # (a child has received them: theta.commands.filter.forked_receive)
                got = forked.received(worktree, hashes)
            else:
                got = receive(chunks, self.spool_dir, worktree, hashes)
            t_received = time.perf_counter()
        except BaseException:
            if early is not None:
                early.drop()
            raise
        faults.point("clean:received")
        try:
            if early is not None and got.owned:
                early.drop()  # git's bytes were not the work-tree file's: clean what git sent instead
                early = None
            if is_metadata(got.head):
                return got.path.read_bytes()  # already clean (e.g. re-clean of a metadata file)
            if got.head[:1] == b"{" and got.size <= _MAX_GIT_THETA_TEXT:
                from theta.peers.gittheta.files import is_git_theta

                data = got.path.read_bytes()
                if is_git_theta(data):
                    return data  # Git-Theta's own metadata text: already clean
            if Path(path).name in GIT_OWN_FILES:
                return got.path.read_bytes()  # git reads these itself (a `*` pattern catches them): never stored
            if _is_shard_index(got):
                # the index of a sharded checkpoint (a `*` or `*.json` pattern catches it): its shards are
                # tracked files of their own, so it stays the small JSON text it is -- stored as a checkpoint
                # it would duplicate every shard and could not be checked out as one file
                return got.path.read_bytes()
            t0 = time.perf_counter()
            if early is not None:
                previous_text, meta, stats, before = early.outcome()
                t0 = early.t0
            else:
                before = _stat_key(got.path) if not got.owned else None
                previous_text = self.previous_text(path)
                previous = self.previous(path, previous_text)
                committed = self.git_theta_committed(path) if previous is None and path else None
                if committed is not None:
                    text, gtf = committed
                    gtf.fetch()
                    if gtf.matches(got.path):
                        return text
                    from theta.peers.gittheta.files import to_theta_metadata

                    previous = to_theta_metadata(gtf, self.spool_dir)
                meta, stats = self._clean_file(path, got.path, previous)
            for w in stats.warnings:
                log(f"warning: {path}: {w}")
            if before is not None and _stat_key(got.path) != before:
                raise ThetaError(f"{path}: the file changed while git was adding it; run `git add` again")
            if settings.env("TIMING"):
                log(f"clean {path}: {got.size / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f}s "
                    f"({'spooled' if got.owned else 'read in place'}"
                    f"{', while git sent it' if early is not None else ''}"
                    f"{', received by a forked child' if forked is not None else ''}"
                    f"{f', {early.hashes.hashed} groups hashed from them' if early is not None and early.hashes is not None else ''}; "
                    f"git's bytes received "
                    f"{t_received - t_request:.2f}s after the request, the clean done "
                    f"{time.perf_counter() - t_request:.2f}s after)")
            text = dumps(meta, file=path).encode("utf-8")
            faults.point("clean:done")
            if previous_text is not None and previous_text != text and same_content(previous_text, text):
                return previous_text  # the same checkpoint committed by an older theta: keep its bytes
            return text
        finally:
            if early is not None:
                early.drop()  # no-op once its outcome was taken
            got.cleanup()

    def _clean_file(self, path: str, file: Path, previous, stop=None, hashes=None):
        """(metadata, CleanStats) of the checkpoint at ``file`` (the content of ``path``); a file theta cannot
        read as a checkpoint is stored as one opaque blob."""
        from theta.model.clean import CleanStats, store_opaque
        from theta.base.errors import NotCheckpointError
        from theta.model.views import clean_as_committed

        stats = CleanStats()
        try:
            meta = clean_as_committed(file, self.store, previous, settings.clean_options(self.cwd),
                                      settings.commit_format(), stats=stats, name=path, stop=stop,
                                      git_bytes=hashes)
        except NotCheckpointError as e:
            # not a checkpoint (a README under `* filter=theta`, a zip, a damaged file): keep its bytes as
            # one blob, as git-lfs would, and say so on one line
            reason = " ".join(e.reason.replace(str(file), path).split())[:200]
            log(f"warning: {path} is not a checkpoint theta can read ({reason}); stored as one opaque blob")
            meta = store_opaque(file, self.store)
        except CleanStopped:
            raise
        except ThetaError as e:
            raise ThetaError(str(e).replace(str(file), path)) from None
        return meta, stats

    def _clean_early(self, path: str, worktree: Path | None) -> "_EarlyClean | None":
        """Start cleaning the work-tree file while git's bytes still arrive (they are that file's in a
        `git add`): reading git's pipe and comparing it with the file overlaps the clean instead of preceding
        it. None when the bytes must be seen first (no such file, ``GIT_THETA_SPOOL=always``, metadata,
        Git-Theta text, git's own files, a file whose committed version Git-Theta wrote) or when there is no
        thread to clean on (``GIT_THETA_THREADS=1``)."""
        from theta.base import parallel
        from theta.storage.metadata import is_metadata

        if worktree is None or not path or settings.env("SPOOL") == "always" or Path(path).name in GIT_OWN_FILES:
            return None
        if parallel.CODEC_THREADS <= 1:
            # GIT_THETA_THREADS=1: the "clean" pool runs inline, so an early clean would run before git's bytes
            # are received, on the thread that receives them, and wait for their hashes for good
            return None
        try:
            if not worktree.is_file():
                return None
            before = _stat_key(worktree)
            with open(worktree, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        if is_metadata(head) or head.lstrip()[:1] == b"{" or before is None:  # JSON: metadata, shard indexes
            return None
        previous_text = self.previous_text(path)
        previous = self.previous(path, previous_text)
        if previous is None and self.git_theta_committed(path) is not None:
            return None
        # git's bytes are hashed group by group instead of compared (theta.model.git_bytes) when they surely are the
        # work-tree file's: the commands that add it (another command may send other bytes under its name,
        # e.g. `git hash-object --path`; those are compared byte by byte, and spooled when they differ)
        hashes = GroupHashes(path) if self.invoker() in ADDS_WORK_TREE else None
        return _EarlyClean(lambda stop: (previous_text, *self._clean_file(path, worktree, previous, stop, hashes),
                                         before), hashes)

    def smudge(self, path: str, chunks: Iterable[bytes], out: "callable", can_delay: bool = False,
               stream: "callable | None" = None, blob: str | None = None) -> bool:
        """Rebuild the checkpoint of the metadata in ``chunks`` and hand its file to ``out(file)``.

        A checkpoint larger than ``settings.checkout_settings().materialize_above`` is not rebuilt: git gets
        the metadata text itself (a placeholder), which :meth:`finish` replaces with the checkpoint once git
        is done (``blob``: the blob id git named in the request, else computed).

        With ``stream`` (a callable returning a writable stream, called at most once, just before the first
        byte), formats that can be written without seeking go straight to that stream, with no temp file.

        With ``can_delay`` (git's delay capability) a file whose blobs are not all local is set aside and True
        is returned: :meth:`available` later fetches the blobs of every delayed file in one git-lfs run.
        """
        from theta.base.errors import TransferError
        from theta.storage.transfer import fetch_missing
        from theta.storage.metadata import is_metadata, loads
        from theta.model.smudge import check_rebuildable, check_space, smudge_checkpoint, smudge_to_stream, streams
        from theta.updates.bounds import check_output

        if path in self.ready:  # a delayed file git asks for again (its content section is empty)
            for _ in chunks:
                pass
            text = self.ready.pop(path)
            got = None
        else:
            got = receive(chunks, self.spool_dir, None)
        try:
            if got is not None and got.head[:1] == b"{" and self._smudge_git_theta(path, got, out, stream):
                return False
            if got is not None and not is_metadata(got.head):  # committed before theta tracked it: pass through
                with open(got.path, "rb") as f:
                    out(f)
                return False
            if got is not None:
                text = got.path.read_bytes()
            meta = loads(text, file=path)
            if self._as_placeholder(meta):
                from theta.commands.filter.materialize import Placeholder

                if not self.checkout_settings().skip and not self._for_a_diff():
                    oid = blob or gitutil.blob_id(text, self._hash_name())
                    self.placeholders[path] = Placeholder(path, text, oid, issued_ns=time.time_ns(), meta=meta)
                out(io.BytesIO(text))
                return False
            # everything the metadata alone can refuse is refused before any download or byte of output
            fmt = settings.checkout_format(path, self.cwd)
            limit = self.max_output()
            if meta.is_opaque:
                check_output(meta, path, limit)
            else:
                check_rebuildable(meta, path, fmt, limit)
            check_space(meta, (self.cwd / path).parent, path)
            if can_delay and self.store.missing(meta.blob_refs()):
                self.delayed[path] = text
                return True
            try:
                fetch_missing(self.cwd, meta.blob_refs(), store=self.store)
            except TransferError as e:
                raise TransferError(f"{path}: {_first_missing_group(meta, self.store)}{e}") from None
            verify = self.verify()
            faults.point("smudge:fetched")
            if stream is not None and streams(meta, fmt, Path(path).name):
                lazy = _Lazy(stream)
                smudge_to_stream(meta, self.store, lazy, Path(path).name, fmt=fmt,
                                 progress=settings.stderr_is_terminal(), verify=verify, max_output=limit)
                if lazy.out is None:
                    lazy.out = stream()  # an empty file: success with empty content
                faults.point("smudge:done")
                return False
            fd, tmp = tempfile.mkstemp(prefix="smudge-", dir=self.spool_dir)
            os.close(fd)
            try:
                smudge_checkpoint(meta, self.store, tmp, fmt=fmt, progress=settings.stderr_is_terminal(), verify=verify,
                                  max_output=limit)
                with open(tmp, "rb") as f:
                    out(f)
                faults.point("smudge:done")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return False
        finally:
            if got is not None:
                got.cleanup()

    def _smudge_git_theta(self, path: str, got: "Received", out, stream) -> bool:
        """Check out Git-Theta metadata as Git-Theta would (theta.peers.gittheta.files); False if it is not that."""
        from theta.peers.gittheta.files import GitThetaFile, is_git_theta

        if got.size > _MAX_GIT_THETA_TEXT:
            return False
        data = got.path.read_bytes()
        if not is_git_theta(data):
            return False
        gtf = GitThetaFile(data, path, self.cwd, self.store)
        gtf.fetch()
        fmt = settings.checkout_format(path, self.cwd)
        if stream is not None and fmt in (None, "torch"):
            gtf.write_to(_Lazy(stream), Path(path).name)
            return True
        fd, tmp = tempfile.mkstemp(prefix="smudge-", dir=self.spool_dir)
        os.close(fd)
        try:
            gtf.write(tmp, fmt)
            with open(tmp, "rb") as f:
                out(f)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True

    def close(self) -> None:
        """Remove this process's scratch directory (a killed process's is swept by the next one)."""
        import shutil

        shutil.rmtree(self.spool_dir, ignore_errors=True)

    def max_output(self) -> int:
        """theta.maxCheckoutBytes (read once per process)."""
        if self._max_output is None:
            self._max_output = settings.max_checkout_bytes(self.cwd)
        return self._max_output

    def invoker(self) -> str:
        """The git subcommand that started this process ("" when unknown), asked once."""
        if self._invoker is None:
            self._invoker = gitutil.invoking_subcommand() or ""
        return self._invoker

    def _for_a_diff(self) -> bool:
        """Whether this process smudges for theta's diff driver or textconv (see DIFFS_BLOBS)."""
        if self._diff is None:
            self._diff = self.invoker() in DIFFS_BLOBS and not (
                os.environ.get("GIT_EXTERNAL_DIFF") or gitutil.config_get("diff.external", self.cwd))
        return self._diff

    def _hash_name(self) -> str:
        if self._hash is None:
            self._hash = gitutil.object_format(self.cwd)
        return self._hash

    def checkout_settings(self):
        """How checkout writes theta files (read once per process: theta.settings.checkout_settings)."""
        if self._checkout is None:
            self._checkout = settings.checkout_settings(self.cwd)
        return self._checkout

    def _as_placeholder(self, meta) -> bool:
        from theta.commands.filter.materialize import data_bytes

        cs = self.checkout_settings()
        if cs.skip or self._for_a_diff():
            return True
        if data_bytes(meta) <= cs.materialize_above:
            return False
        # git archive and `git cat-file --filters` want the content itself: nothing writes it afterwards
        return self.invoker() not in CONTENT_WANTED

    def finish(self) -> None:
        """git has closed the request stream: it has written the work tree and the index and waits for this
        process to exit. Replace the placeholders handed out with their checkpoints (see
        theta.commands.filter.materialize); say what is left and how to finish it."""
        from theta.commands.filter.materialize import Outcome, materialize, report

        if not self.placeholders:
            return
        pending = list(self.placeholders.values())
        self.placeholders.clear()
        t0 = time.perf_counter()
        try:
            outcome = materialize(self.cwd, pending, store=self.store, verify=self.verify(),
                                  hash_name=self._hash_name())
        except Exception as e:  # never leave git without a word: every file is still a (clean) placeholder
            _report("", "checkout", e)
            outcome = Outcome(left=[(p.path, "materialization failed") for p in pending])
        if settings.env("TIMING"):
            log(f"materialized {len(outcome.done)} file(s) in {time.perf_counter() - t0:.2f}s")
        report(outcome)

    def verify(self) -> str:
        """How checkout verifies rebuilt groups (read once per process: theta.settings.verify_mode)."""
        if self._verify is None:
            self._verify = settings.verify_mode(self.cwd)
        return self._verify

    def available(self) -> list[str]:
        """Answer git's list_available_blobs: fetch the blobs of all delayed files at once, return their paths.

        A failed download is not reported here: git asks for each file again and its smudge reports the
        error naming the file, the group and the blob.
        """
        from theta.base.errors import TransferError
        from theta.storage.transfer import fetch_missing
        from theta.storage.metadata import loads

        if not self.delayed:
            return []
        refs = [r for path, text in self.delayed.items() for r in loads(text, file=path).blob_refs()]
        t0 = time.perf_counter()
        try:
            n = fetch_missing(self.cwd, refs, store=self.store)
            if settings.env("TIMING"):
                log(f"fetched {n} blob(s) for {len(self.delayed)} file(s) in one git-lfs run "
                    f"({time.perf_counter() - t0:.2f}s)")
        except TransferError:
            pass
        paths = list(self.delayed)
        self.ready.update(self.delayed)
        self.delayed.clear()
        return paths


# Git-Theta metadata is JSON of ~1 KB per group; larger "{"-content is a checkpoint, not metadata.
_MAX_GIT_THETA_TEXT = 256 << 20


def _is_shard_index(got: "Received") -> bool:
    """Is the content a sharded checkpoint's ``*.index.json`` (JSON naming a shard file per tensor)?"""
    import zipslice
    from zipslice.errors import ZipsliceError
    from zipslice.sharded import MAX_INDEX_BYTES

    if got.head.lstrip()[:1] != b"{" or got.size > MAX_INDEX_BYTES:
        return False
    try:
        return zipslice.sniff(got.path) == "sharded"
    except (ZipsliceError, OSError):
        return False


class _Lazy:
    """A writable stream opened by its first write (so nothing is announced to git before there is data)."""

    def __init__(self, opener):
        self.opener, self.out = opener, None

    def write(self, data) -> int:
        if self.out is None:
            self.out = self.opener()
        return self.out.write(data)


def _first_missing_group(meta, store) -> str:
    """'group NAME needs blob OID; ' for the first group whose blob is not local (for error messages)."""
    for name in sorted(meta.groups):
        for step in meta.groups[name].steps:
            if not store.has(step.blob):
                return f"group {name!r} needs blob {step.blob.oid}; "
    return ""


def _stat_key(p: Path):
    st = p.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


# -- the protocol ----------------------------------------------------------------------------------------
def _grow_pipes(*streams: BinaryIO) -> None:
    """Ask for 1 MiB pipe buffers to and from git (Linux; default 64 KiB, one packet): git and the filter
    then block on each other ~16x less often while a checkpoint streams through. Best effort."""
    if settings.env("PIPE_SIZE") == "0":
        return
    for s in streams:
        try:
            grow_pipe(s.fileno(), _PIPE_BYTES)
        except (OSError, ValueError, AttributeError):
            pass  # no file descriptor (a test's stream)


_PIPE_BYTES = 1 << 20


def serve(stdin: BinaryIO, stdout: BinaryIO, cwd: str | os.PathLike = ".") -> int:
    _grow_pipes(stdin, stdout)
    r, w = PktReader(stdin, _PIPE_BYTES), PktWriter(stdout)  # (reads a pipe's worth at a time)
    hello = r.read_text_list()
    if hello[:1] != ["git-filter-client"] or "version=2" not in hello[1:]:
        raise ProtocolError(f"filter protocol: unexpected greeting {hello!r}")
    w.text_list(["git-filter-server", "version=2"])
    caps = r.read_text_list()
    offered = ["capability=clean", "capability=smudge"]
    if settings.env("DELAY", "1") != "0":
        offered.append("capability=delay")  # batch the downloads of a whole checkout (see Filter.available)
    w.text_list([c for c in offered if c in caps])

    # the first request is read now: a `git add`'s content is received by a forked child while this process
    # imports what the clean needs (git waits for the first read of its content, a core idle meanwhile)
    from theta.commands.filter import forked_receive

    try:
        pending = r.read_pairs()
    except EOFError:
        pending = None
    forked, root = None, Path(cwd).resolve()
    if pending is not None and (file := forked_receive.wanted(pending, root)) is not None:
        forked = forked_receive.start(r, file, root)

    # one git config -l and one rev-parse instead of one process per read, run while the hook check's modules
    # (numpy) are imported
    from theta.base import parallel

    remembering = parallel.pool("start").submit(gitutil.remember_reads, cwd)
    from theta.commands.hooks import ensure_installed_quietly
    from theta.base.errors import GitError

    try:
        remembering.result()
    except GitError:
        pass  # not a repository: Filter() below says so in its own words
    ensure_installed_quietly(cwd)
    filt = Filter(cwd)
    while True:
        try:
            if pending is None:
                raise EOFError
            header, pending = pending, {}
            if not header:
                header = r.read_pairs()
        except EOFError:
            filt.finish()
            filt.close()
            if stdin is getattr(sys.stdin, "buffer", None):
                _exit_now()
            return 0
        command, path = header.get("command"), header.get("pathname", "")
        if command == "list_available_blobs":  # no content section
            try:
                paths = filt.available()
            except Exception as e:  # answer git rather than die: it then reports the files as missing
                _report("", command, e)
                paths = []
            w.text_list([f"pathname={p}" for p in paths])
            w.text_list(["status=success"])
            continue
        chunks = r.iter_content_views()  # (each consumed before the next: receive and _spool_all)
        received_by, forked = forked, None  # the first request's content: a child's
        content = None  # the content section being streamed to git, if one was started
        try:
            if command == "clean":
                data = filt.clean(path, chunks, received_by)
                w.text_list(["status=success"])
                if data:
                    w.packet(data)
                w.flush()
            elif command == "smudge":
                def send(f):  # a file rebuilt completely (and checked) before status=success goes out
                    w.text_list(["status=success"])
                    w.content_from(f)

                def open_content():  # streamed: content packets go out while the file is rebuilt
                    nonlocal content
                    w.text_list(["status=success"])
                    content = w.content()
                    return content
                if filt.smudge(path, chunks, send, can_delay=header.get("can-delay") == "1",
                               stream=open_content, blob=header.get("blob")):
                    w.text_list(["status=delayed"])
                    continue
                if content is not None:
                    content.close()
                    content = None
            else:
                for _ in chunks:
                    pass
                raise ThetaError(f"unsupported filter command {command!r}")
            w.flush()  # empty list: keep status=success
        except ProtocolError:
            filt.close()  # git's stream is broken: this process ends, and leaves no scratch directory
            raise
        except Exception as e:  # report any failure to git as status=error for this file, keep serving
            if received_by is not None:
                received_by.abandon()
            else:
                for _ in chunks:  # drain whatever git still sends for this file
                    pass
            _report(path, command, e)
            if content is not None:  # content (partly) sent: end it; the error then makes git drop it
                content.close()
            w.text_list(["status=error"])


def _exit_now() -> None:
    """git closed our stdin: every request was answered. Leave without the interpreter's teardown (freeing
    every module and joining idle pools costs ~0.1 s, which git waits for at the end of each add/checkout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    from theta import warm

    warm.leaving(0)  # (a warm child reports to its client; a cold filter leaves a warm server behind)
    os._exit(0)


def _report(path: str, command: str | None, e: Exception) -> None:
    if isinstance(e, ThetaError):
        log(f"error: {command} {path}: {e}")
    else:
        log(f"error: {command} {path}: {type(e).__name__}: {e}")
        if settings.env("DEBUG"):
            traceback.print_exc(file=sys.stderr)
