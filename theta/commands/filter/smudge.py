"""The filter's smudge requests (metadata text -> checkpoint).

Fetch all missing blobs of the file in one git-lfs run, then rebuild the checkpoint group by group. A torch
checkpoint streams to git while it is rebuilt (its writer never seeks); other formats are written to a temporary
file first, then sent. The output format is the committed one unless the path has the attribute
``theta-format=<torch|safetensors|hdf5>`` or ``git config theta.checkoutFormat`` is set. A checkpoint over
``theta.materializeAbove`` is handed to git as its metadata text (a placeholder) and written by
:meth:`SmudgeRequests.finish` once git is done (:mod:`theta.commands.filter.materialize`).
"""
from __future__ import annotations

import io
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable

from theta import settings
from theta.base import faults
from theta.base.errors import TransferError
from theta.commands.filter.handoff import Ledger
from theta.commands.filter.materialize import Outcome, Placeholder, data_bytes, materialize, report
from theta.commands.filter.messages import log, report_error
from theta.commands.filter.receive import Received, receive
from theta.git import repo as gitutil
from theta.model.smudge import check_rebuildable, check_space, smudge_checkpoint, smudge_to_stream, streams
from theta.peers.gittheta import files as gittheta_files
from theta.storage.metadata import is_metadata, loads
from theta.storage.transfer import fetch_missing
from theta.updates.bounds import check_output

# git commands whose smudged content goes somewhere other than the work tree (an archive, stdout)
CONTENT_WANTED = frozenset({"archive", "cat-file"})


class SmudgeRequests:
    """The smudge half of :class:`theta.commands.filter.session.Filter` (it holds the state both halves use)."""

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
                if not self.checkout_settings().skip and not self._for_a_diff():
                    oid = blob or gitutil.blob_id(text, self._hash_name())
                    p = self.placeholders[path] = Placeholder(path, text, oid, issued_ns=time.time_ns(), meta=meta)
                    if self.ledger is None:
                        self.ledger = Ledger(self.cwd)
                    self.ledger.add(path, oid, p.issued_ns)
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
                                  name=Path(path).name,
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
        data = gittheta_files.metadata_text(got.path, got.head, got.size)
        if data is None:
            return False
        gtf = gittheta_files.GitThetaFile(data, path, self.cwd, self.store)
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

    def _as_placeholder(self, meta) -> bool:
        cs = self.checkout_settings()
        if cs.skip:
            return True
        if self.single_file:
            return False
        if self._for_a_diff():
            return True
        if data_bytes(meta) <= cs.materialize_above:
            return False
        # git archive and `git cat-file --filters` want the content itself: nothing writes it afterwards
        return self.invoker() not in CONTENT_WANTED

    def finish(self) -> None:
        """git has closed the request stream: it has written the work tree and the index and waits for this
        process to exit. Replace the placeholders handed out with their checkpoints (see
        theta.commands.filter.materialize) unless a hook took them (theta.commands.filter.handoff); say what is
        left and how to finish it."""
        if not self.placeholders:
            return
        pending = list(self.placeholders.values())
        self.placeholders.clear()
        if self.ledger is not None:
            if self.ledger.taken():  # a hook wrote them, or said why not
                return
            self.ledger.remove()
        t0 = time.perf_counter()
        try:
            outcome = materialize(self.cwd, pending, store=self.store, verify=self.verify(),
                                  hash_name=self._hash_name())
        except Exception as e:  # never leave git without a word: every file is still a (clean) placeholder
            report_error("", "checkout", e)
            outcome = Outcome(left=[(p.path, "materialization failed") for p in pending])
        if settings.env("TIMING"):
            log(f"materialized {len(outcome.done)} file(s) in {time.perf_counter() - t0:.2f}s")
        report(outcome)

    def available(self) -> list[str]:
        """Answer git's list_available_blobs: fetch the blobs of all delayed files at once, return their paths.

        A failed download is not reported here: git asks for each file again and its smudge reports the
        error naming the file, the group and the blob.
        """
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


