"""One filter process's requests for one repository: :class:`Filter` holds what clean and smudge requests share
(the store, the scratch directory, the settings read once per process, the invoking git command) and answers
both (:mod:`theta.commands.filter.clean`, :mod:`theta.commands.filter.smudge`)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from theta import settings
from theta.base.errors import MetadataError
from theta.commands.filter.clean import CleanRequests
from theta.commands.filter.handoff import Ledger
from theta.commands.filter.messages import log
from theta.commands.filter.smudge import SmudgeRequests
from theta.git import repo as gitutil
from theta.storage.committed import committed_text
from theta.storage.metadata import loads
from theta.storage.store import LfsStore

# git commands that smudge only to give a diff program or theta's textconv a temp file: they get the metadata
# text, whatever the checkpoint's size, and theta reads it as it reads any committed version (from the store;
# a work-tree file is then named like its committed text). A user's own external diff still gets the checkpoint.
DIFFS_BLOBS = frozenset({"diff", "log", "show", "whatchanged", "blame", "annotate", "grep"})


class Filter(CleanRequests, SmudgeRequests):
    """Clean and smudge for one repository (the process's working directory)."""

    def __init__(self, cwd: str | os.PathLike = ".", single_file: bool = False):
        self.cwd = Path(cwd).resolve()
        self.store = LfsStore.for_repo(self.cwd)
        self.spool_dir = gitutil.scratch_dir(self.cwd)  # ours alone; what killed filters left is swept
        self.delayed: dict[str, bytes] = {}   # smudges set aside until list_available_blobs (path -> metadata)
        self.ready: dict[str, bytes] = {}     # delayed files whose blobs were fetched, awaiting git's request
        self.placeholders: dict = {}          # path -> Placeholder handed to git, materialized by finish()
        self.ledger: Ledger | None = None     # the same, where a hook can take them (filter.handoff)
        self._verify: str | None = None
        self._max_output: int | None = None
        self._checkout = None
        self._invoker: str | None = None  # the git subcommand that started this process, once asked
        self._hash: str | None = None     # the repository's object format, once asked
        self._diff: bool | None = None    # smudging for a diff (_for_a_diff), once asked
        # one file per process (theta.commands.filter.single_file): no end of a checkout to materialize at, so a
        # smudge writes the checkpoint itself whatever its size (unless checkouts are skipped altogether)
        self.single_file = single_file

    def previous_text(self, path: str) -> bytes | None:
        """The metadata text of ``path`` in the index, else in HEAD (what clean may reuse), or None."""
        return committed_text(path, self.cwd)

    def previous(self, path: str, text: bytes | None = None):
        """The metadata of ``path`` in the index, else in HEAD (what clean may reuse), or None."""
        data = text if text is not None else self.previous_text(path)
        if data is None:
            return None
        try:
            meta = loads(data, file=path)
        except MetadataError as e:
            log(f"warning: {path}: previous metadata unreadable ({e}); storing every group anew")
            return None
        return None if meta.is_opaque else meta

    def close(self) -> None:
        """Remove this process's scratch directory (a killed process's is swept by the next one)."""
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

    def verify(self) -> str:
        """How checkout verifies rebuilt groups (read once per process: theta.settings.verify_mode)."""
        if self._verify is None:
            self._verify = settings.verify_mode(self.cwd)
        return self._verify
