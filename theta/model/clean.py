"""Clean: turn a checkpoint file into metadata, storing each changed parameter group as an LFS blob.

One group at a time (memory ~ 2 x the largest group, + its previous value when comparing):

1. hash the group's bytes with xxh3-128; same fast hash as the previous version -> reuse its steps (no
   blob, no LSH, no value hash); otherwise (or when the previous metadata predates fast hashes, or with
   ``exact``) the value's name decides (:mod:`theta.base.valuehash`: hashed in the previous name's algorithm),
   and a changed value is named anew (BLAKE3);
2. float groups: E2LSH signature; if it says "maybe close" to the previous version, rebuild the previous
   value and compare with allclose(rtol, atol) -> if close, the group is unchanged (reuses previous steps);
   with ``exact=True`` only identical bytes count as unchanged;
3. otherwise :func:`encode_changed_group` stores the change (the seam the update policies replace).
"""
from __future__ import annotations

import math
import os
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

import zipslice
from zipslice import dtypes
from zipslice.errors import NotACheckpointError, ZipsliceError
from zipslice.progress import Bar

from theta.base import lsh, numeric, parallel, valuehash
from theta.base.errors import (BlobMissingError, CheckpointError, CleanStopped, FileChanged, IntegrityError,
                               MetadataError, NotCheckpointError, ThetaError, UpdateTypeError)
from theta.base.parallel import READ_AHEAD_GROUPS
from theta.model import framewise, norms
from theta.peers.gittheta.update_files import open_for_clean
from theta.storage import codec
from theta.storage.metadata import OPAQUE_FORMAT, OPAQUE_VERSION, Alias, CheckpointMeta, GroupMeta, Norms, Step
from theta.storage.schema import MAX_STEPS
from theta.storage.store import LfsStore
from theta.updates import content_hash, fast_hash, fast_hash_pieces, keyframe
from theta.updates.auto import dense_estimate, encode_change
from theta.updates.rebuild import bind_steps, decode_proven_dense, reconstruct_proven
from theta.updates.steps import chain_full, store_staged

if TYPE_CHECKING:
    from concurrent.futures import Future

    from theta.model.git_bytes import GroupHashes


_OPAQUE_CHUNK = 8 << 20


@dataclass
class CleanOptions:
    """How :func:`clean_checkpoint` decides and stores changes; the git filter fills it from
    ``git config theta.<field>`` and ``GIT_THETA_<FIELD>`` (see the settings reference).

    Attributes:
        level: zstd level of new blobs; 0 is theta's preset for weight planes.
        rtol: a changed float group within ``allclose(rtol, atol)`` of its previous value counts as unchanged.
        atol: see ``rtol``.
        exact: only identical bytes count as unchanged (``rtol``/``atol`` ignored).
        update_type: how a changed group is stored: ``auto`` (smallest exact form), ``dense``, ``sparse``,
            ``delta``, ``low-rank``, ``ia3``, ``rows`` or a plugin's name.
        update_data: a side-loaded update file (Git-Theta's part names), or None.
        max_chain: the longest step chain before a self-contained (dense) step.
        keyframe_ratio: ``auto`` keeps the bytes a fresh checkout of a changed group fetches within this multiple
            of what the value alone costs (:mod:`theta.updates.keyframe`; a large value turns keyframes off).
        progress: show a progress bar on stderr (only when it is a terminal).
    """

    level: int = codec.DEFAULT_LEVEL        # zstd level of new blobs
    rtol: float = 1e-5                      # a changed float group within allclose(rtol, atol) of its
    atol: float = 1e-8                      # previous version counts as unchanged...
    exact: bool = False                     # ...unless exact: only identical bytes are unchanged
    update_type: str = "auto"               # how changed groups are stored (CORE: "auto" = dense)
    update_data: Path | None = None         # side-loaded update file (UPDATES)
    max_chain: int = 8                      # longest step chain before a self-contained step
    keyframe_ratio: float = keyframe.DEFAULT_RATIO  # a chain fetches at most this x a self-contained copy
    progress: bool = False                  # progress bar on stderr (only when it is a terminal)
    isolate: bool = False                   # parse natively-parsed formats (HDF5) in a child process
                                            # (zipslice.load(isolate=True)); the git filter turns it on
    isolate_timeout: float = 60.0           # seconds the child may take to open the file

    def __post_init__(self) -> None:
        if not (isinstance(self.max_chain, int) and 1 <= self.max_chain <= MAX_STEPS):
            raise ThetaError(f"max_chain (theta.maxChain) must be an integer from 1 to {MAX_STEPS}, "
                             f"got {self.max_chain!r}")
        r = self.keyframe_ratio
        if not (isinstance(r, (int, float)) and not math.isnan(r) and r >= 1):
            raise ThetaError(f"keyframe_ratio (theta.keyframeRatio) must be a number >= 1, got {r!r}")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ThetaError(f"{name} (theta.{name}) must be a finite number >= 0, got {v!r}")
        t = self.isolate_timeout
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ThetaError(f"isolate_timeout (theta.isolateTimeout) must be a positive number of seconds, "
                             f"got {t!r}")
        if not (isinstance(self.level, int) and -(1 << 17) <= self.level <= 22):
            raise ThetaError(f"level (theta.level) must be a zstd level (at most 22), got {self.level!r}")


@dataclass
class CleanStats:
    """Counters of one :func:`clean_checkpoint` call (pass ``stats=CleanStats()`` to get them)."""

    groups: int = 0
    aliases: int = 0
    unchanged: int = 0          # same bytes as the previous version
    close: int = 0              # allclose to the previous version (kept the previous value)
    written: int = 0            # groups stored as new steps
    raw_bytes: int = 0          # bytes of all groups
    new_blob_bytes: int = 0     # bytes of blobs this clean added to the store
    by_type: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # one line each, for the caller to show


def encode_changed_group(name: str, new: np.ndarray, new_hash: str, previous: GroupMeta | None,
                         previous_value: Callable[[], np.ndarray | None], store: LfsStore,
                         options: CleanOptions, update_data=None, *,
                         reshaped_previous: GroupMeta | None = None,
                         on_previous: Callable[[int, int, np.ndarray], None] | None = None) -> list[Step]:
    """THE SEAM: store a group whose value changed and return its new step chain.

    ``new`` has the group's real dtype and shape; ``new_hash`` its content hash. ``previous`` is the group
    in the previous metadata (same dtype and shape) or None; ``previous_value()`` rebuilds it (None when
    there is none or its blobs are not in the local store). Steps are stored with
    :func:`theta.updates.steps.store_step` and chained within ``options.max_chain``.
    The policy (auto/sparse/low-rank/ia3/delta, side-loaded ``update_data``) is theta.updates.auto's.
    ``reshaped_previous``: the previous version of a group whose dtype or shape changed (``previous`` is
    then None), a base for updates that change the shape (``rows``). ``on_previous``:
    theta.updates.auto.encode_change's.
    """
    return encode_change(name, new, new_hash, previous, previous_value, store, options, update_data=update_data,
                         reshaped_previous=reshaped_previous, on_previous=on_previous)


def clean_checkpoint(path: str | os.PathLike, store: LfsStore, previous: CheckpointMeta | None = None,
                     options: CleanOptions | None = None, *, stats: CleanStats | None = None,
                     opener: Callable[[str], zipslice.LazyCheckpoint] | None = None,
                     stop: threading.Event | None = None, git_bytes: "GroupHashes | None" = None) -> CheckpointMeta:
    """The metadata of the checkpoint at ``path``, in the file's own format; new/changed groups are put in ``store``.

    ``previous`` is the metadata of the last committed version of the same path (for reuse by tensor name),
    if any. ``opener`` opens the file (default :func:`zipslice.load`). ``stop``: once set, the clean ends
    with CleanStopped before its next group (what it stored stays in the store, unreferenced). A corrupt, unsafe or unreadable
    checkpoint raises CheckpointError naming the file. ``git_bytes``: the hashes of git's bytes of the groups
    (the file's content as git sent it to the filter, theta.model.git_bytes): unchanged groups are recognized by them
    without being read, and every group read must match them. To record a file in its committed format whatever
    format it has in the work tree, see :func:`theta.model.views.clean_as_committed`.
    """
    options = options or CleanOptions()
    stats = stats if stats is not None else CleanStats()
    path = os.fspath(path)
    try:
        try:
            lsd = opener(path) if opener is not None else zipslice.load(path, isolate=options.isolate,
                                                                         timeout=options.isolate_timeout)
        except BaseException:
            if git_bytes is not None:
                git_bytes.no_layout()  # git's bytes are compared instead, from now (not once the caller is done)
            raise
    except NotACheckpointError as e:
        raise NotCheckpointError(f"cannot clean {path}: {e}", reason=str(e)) from e
    except ZipsliceError as e:
        raise CheckpointError(f"cannot clean {path}: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        with lsd:
            return _clean(lsd, path, store, previous, options, stats, stop, git_bytes)
    except ZipsliceError as e:
        raise CheckpointError(f"cannot clean {path}: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e


def store_opaque(path: str | os.PathLike, store: LfsStore) -> CheckpointMeta:
    """The metadata of a file that is not a checkpoint, stored as ONE blob of its exact bytes (the blob's oid
    is the file's sha256, as git-lfs would name it); a checkout copies it back bit for bit."""
    def chunks():
        with open(path, "rb") as f:
            while True:
                buf = f.read(_OPAQUE_CHUNK)
                if not buf:
                    return
                yield buf

    try:
        ref = store.put_stream(chunks())
    except OSError as e:
        raise CheckpointError(f"cannot read {os.fspath(path)}: {e.strerror or e}") from e
    return CheckpointMeta(format=OPAQUE_FORMAT, order=[], groups={}, opaque=ref, version=OPAQUE_VERSION)


def _clean(lsd, path: str, store: LfsStore, previous: CheckpointMeta | None, options: CleanOptions,
           stats: CleanStats, stop: threading.Event | None = None, git_bytes=None) -> CheckpointMeta:
    order = list(lsd)
    groups: dict[str, GroupMeta] = {}
    aliases: dict[str, Alias] = {}
    tie_owner: dict = {}
    same_lsh = previous is not None and previous.lsh == lsh.PARAMS
    update_data = None
    if options.update_data is not None:
        update_data = open_for_clean(options, lsd, previous)  # checked up front: a bad file stores nothing
    bar = Bar(f"theta clean {Path(path).name}", sum(lsd.info(k).nbytes for k in order), options.progress)
    group_keys = []
    for key in order:
        info = lsd.info(key)
        tie = lsd.source(key).tie
        if tie is not None and tie in tie_owner:
            aliases[key] = Alias(key, tie_owner[tie], info.is_parameter, info.requires_grad)
            stats.aliases += 1
            continue
        if tie is not None:
            tie_owner[tie] = key
        group_keys.append(key)
    # Pipeline: a reader thread reads and hashes the next groups (up to READ_AHEAD_GROUPS, at most
    # READ_AHEAD_BYTES in all -- less in a small cgroup: parallel.read_ahead_budget -- so read-ahead never adds
    # more than that to peak memory) while this thread encodes and stores group i (hashlib, preadv, zstd and
    # numpy release the GIL).
    # The memory bound is 2 x the largest group: while a changed group is encoded against its previous value
    # (2 x its size), read-ahead only fills what is left of that, so it never adds to the peak.
    sent = _lay_out(lsd, path, group_keys, git_bytes) if git_bytes is not None else None
    unproven: list = []  # (key, fast hash) of groups read before git's hash of them was asked for
    largest = max((lsd.info(k).nbytes for k in group_keys), default=0)
    if any(lsh.hashable(lsd.info(k).dtype) for k in group_keys):
        # the signatures' random directions (~20 ms to draw) while the first group is still being read
        parallel.pool("hash").submit(lsh.directions)

    def read_whole(key: str) -> bool:
        """A side-loaded group is checked against its update even when its bytes did not change."""
        return update_data is not None and key in update_data
    stream = update_data is None and options.update_type in ("auto", "dense")  # what a frame pass can store
    pending: list = []  # (index, future) in order
    nxt = 0  # the next group index not yet read or submitted
    ahead_cap = parallel.read_ahead_budget()
    try:
        for i, key in enumerate(group_keys):
            if stop is not None and stop.is_set():
                raise CleanStopped(f"clean of {path} stopped")
            if pending and pending[0][0] == i:
                got = pending.pop(0)[1].result()
            else:
                got = _read_group(lsd, key, previous, options.exact, read_whole(key), sent, stream)
            nxt = max(nxt, i + 1)
            ahead = sum(lsd.info(group_keys[j]).nbytes for j, _ in pending)
            held = _held(got)
            budget = min(ahead_cap, max(2 * largest - held, 0))
            while nxt < len(group_keys) and len(pending) < READ_AHEAD_GROUPS:
                size = lsd.info(group_keys[nxt]).nbytes
                if ahead + size > budget:
                    break
                k = group_keys[nxt]
                pending.append((nxt, parallel.pool("read").submit(_read_group, lsd, k, previous, options.exact,
                                                                read_whole(k), sent, stream)))
                ahead += size
                nxt += 1
            groups[key] = _clean_group(got, store, same_lsh, options, stats, path, update_data)
            if sent is not None and key in sent.keys and got.sent is None:
                unproven.append((key, got.fast))
            del got
            bar.advance(lsd.info(key).nbytes)
        for key, fast in unproven:  # (git's bytes have all arrived by now, or never will)
            sent.hashes.check(key, fast)
    finally:
        for _, fut in pending:
            if not fut.cancel() and fut.exception() is None:  # never close the file under a running read,
                fut.result().settle()                          # nor leave its hash running
        bar.close()
        if update_data is not None:
            update_data.close()
    return CheckpointMeta(format=lsd.format, order=order, groups=groups, structure=lsd.structure,
                          aliases=aliases, metadata=dict(lsd.metadata or {}), lsh=dict(lsh.PARAMS))


def _held(got: "_Read") -> int:
    """The most a group holds while it is cleaned: its value, and its previous value when it changed. A group
    cleaned frame by frame holds only frames, unless the sparse candidate (both values read whole) or a
    previous version rebuilt from a chain needs them: counted as 2 x its size whenever it has a previous
    version (a "50% pruned" add went 23 MiB over the bound when read-ahead took that room)."""
    if got.frames is not None:
        return 2 * got.info.nbytes if got.prev is not None else 0
    if got.raw is None:
        return 0
    same = got.hashing is None and got.prev is not None and got.prev.hash == got.digest
    return got.raw.nbytes * (1 if same else 2)


@dataclass
class _Sent:
    """The groups whose hashes come from git's bytes (``keys``), and where they come from."""

    hashes: "GroupHashes"
    keys: set


def _lay_out(lsd, path: str, keys: list[str], git_bytes) -> _Sent:
    """Tell the thread receiving git's bytes where each group's bytes lie in the file (theta.model.git_bytes)."""
    ranges = []
    here = os.path.abspath(path)
    plain_range = getattr(lsd, "plain_range", None)
    for key in keys if plain_range is not None else ():
        where = plain_range(key)
        if where is not None and os.path.abspath(where[0]) == here:
            ranges.append((where[1], where[1] + where[2], key))
    return _Sent(git_bytes, git_bytes.expect(ranges))


def _previous_group(previous: CheckpointMeta | None, key: str, dtype: str, shape: tuple) -> GroupMeta | None:
    if previous is None or (key not in previous.groups and key not in previous.aliases):
        return None
    g = previous.group_for(key)
    return g if g.dtype == dtype and tuple(g.shape) == tuple(shape) else None


@dataclass
class _Read:
    """A group read and hashed (by the reader thread), ready for the decision and encoding."""

    key: str
    info: object
    raw: np.ndarray | None     # carrier dtype (unsigned ints of the same width): the exact bits; None for
                               # a group hashed in place and found unchanged (nothing to encode)
    arr: np.ndarray | None     # the same memory viewed with the real dtype
    digest: str                # the value's name (theta.base.valuehash; the previous version's when unchanged)
    fast: str                  # xxh3-128
    prev: GroupMeta | None
    sig: list[int] | None
    reshaped: GroupMeta | None = None  # previous version when its dtype/shape differ (prev is then None)
    squares: float | None = None  # Σ x² of the value, from the pass that signs it (lsh.signed)
    sent: str | None = None    # the fast hash of git's bytes of the group, when it was asked for
    frames: "framewise.GroupFrames | None" = None  # to clean frame by frame (digest and fast set by then)
    hashing: "Future | None" = None  # the value hash taken on the hash thread (digest is "" until resolve())
    sums: "norms.Sums | None" = None  # the value's sums of squares (theta.model.norms), once measured
    base: str | None = None  # the name of the value ``sums.change`` was measured against

    def resolve(self) -> None:
        """Wait for the value hash taken on the hash thread, if one is (it becomes ``digest``)."""
        if self.hashing is not None:
            self.digest, self.hashing = self.hashing.result(), None

    def settle(self) -> None:
        """A read not cleaned after all: wait until nothing works on its bytes any more."""
        if self.hashing is not None:
            self.hashing.cancel() or self.hashing.exception()


_HASH_PIECE = 4 << 20  # bytes per read when a group is hashed in place (one buffer per reader thread)
_pieces = threading.local()


def _fast_hash_in_place(lsd, key: str) -> str | None:
    """The fast hash of ``key``'s bytes read piece by piece through a reused buffer (no group-sized buffer:
    an unchanged group costs its read and its hash only), or None when the format cannot read it that way."""
    buf = getattr(_pieces, "buf", None)
    if buf is None:
        buf = _pieces.buf = bytearray(_HASH_PIECE)
    pieces = lsd.iter_plain(key, buf) if hasattr(lsd, "iter_plain") else None
    return None if pieces is None else fast_hash_pieces(pieces)


def _read_group(lsd, key: str, previous: CheckpointMeta | None, exact: bool = False,
                whole: bool = False, sent: _Sent | None = None, stream: bool = False) -> _Read:
    """Read and hash group ``key``. A group whose fast hash equals its previous version's is not held: its
    ``raw``/``arr`` are None (unless ``whole``: the caller needs the value anyway). ``sent``: the hash of
    git's bytes of the group decides that without reading the file (theta.model.git_bytes). ``stream``: a big
    changed group may be left to be cleaned frame by frame (theta.model.framewise; its ``frames`` are set)."""
    info = lsd.info(key)
    prev = _previous_group(previous, key, info.dtype, info.shape)
    reshaped = previous.group_for(key) if prev is None and previous is not None and (
        key in previous.groups or key in previous.aliases) else None
    git_fast = None
    if prev is not None and prev.fast is not None and not exact and not whole:
        if sent is not None and key in sent.keys:
            git_fast = sent.hashes.hash_of(key)  # (waits for git's bytes of it)
            if git_fast is not None and git_fast == prev.fast:
                return _Read(key, info, None, None, prev.hash, git_fast, prev, None, sent=git_fast)
        if git_fast is None:
            fast = _fast_hash_in_place(lsd, key)
            if fast is not None and fast == prev.fast:
                return _Read(key, info, None, None, prev.hash, fast, prev, None)
    if stream and framewise.streams(lsd, key, info, prev, reshaped, exact):
        # read, hashed and encoded frame by frame when it is cleaned (nothing read here)
        return _Read(key, info, None, None, "", "", prev, None, sent=git_fast,
                     frames=framewise.GroupFrames(lsd, key, info, lsd.path))
    raw = lsd.numpy(key, raw=True)
    arr = raw.view(dtypes.get(info.dtype).to_numpy())
    fast = fast_hash(raw)
    if git_fast is not None and git_fast != fast:
        sent.hashes.check(key, fast)  # raises: the file's bytes are not git's
    hashing = None
    if prev is not None and prev.fast == fast and not exact:
        # unchanged (docs/design/performance.md, "Change detection"): the previous version's name is this
        # value's, and the bytes are never hashed for a name
        digest = prev.hash
    elif (prev is None or prev.fast is not None) and not exact:
        # new, or changed (its fast hash is not its previous one's): the hash only names the value, so it is
        # taken on the hash thread while this one signs the group (_Read.resolve waits for it)
        digest, hashing = "", parallel.pool("hash").submit(content_hash, raw)
    else:  # exact, or a previous version without a fast hash: only its name says whether the value changed
        digest = content_hash(raw, like=prev.hash) if prev is not None else content_hash(raw)
        if prev is not None and digest != prev.hash and not valuehash.is_blake3(digest):
            digest = content_hash(raw)  # changed: named now (an unchanged value keeps its older name)
    # A new group always needs its signature, a group with a previous version only when its bytes changed
    # (an unchanged group costs its hash only). Computed here, on a reader thread, so it overlaps the
    # encoding of the group before.
    # (its sum of squares, the LSH comparison's norm and the recorded one, comes with it)
    sig, squares = None, None
    if lsh.hashable(info.dtype) and (prev is None or hashing is not None or prev.hash != digest):
        sig, squares = lsh.signed(arr)
    return _Read(key, info, raw, arr, digest, fast, prev, sig, reshaped, squares, git_fast, hashing=hashing)


def _clean_group(got: _Read, store: LfsStore, same_lsh: bool, options: CleanOptions, stats: CleanStats,
                 path: str, update_data=None) -> GroupMeta:
    got.resolve()
    key, info, arr, digest, prev, sig = got.key, got.info, got.arr, got.digest, got.prev, got.sig
    dt = dtypes.get(info.dtype)
    stats.groups += 1
    stats.raw_bytes += info.nbytes

    def keep(p: GroupMeta) -> GroupMeta:
        # the previous value is kept: the new bytes' fast hash when they are that value (so metadata written
        # before fast hashes gets them as its groups are met again), else (allclose) the previous one's
        fast = got.fast if p.hash == got.digest else p.fast
        return GroupMeta(name=key, dtype=p.dtype, shape=tuple(p.shape), hash=p.hash, steps=list(p.steps),
                         lsh=p.lsh, is_parameter=info.is_parameter, requires_grad=info.requires_grad, fast=fast,
                         norms=p.norms)

    sideloaded = update_data is not None and key in update_data  # must be checked against the update
    if sideloaded and prev is None and got.reshaped is not None and tuple(got.reshaped.shape) == tuple(info.shape):
        prev = got.reshaped  # another dtype: the update may promote it, as Git-Theta does (sideload.verify decides)
    if prev is not None and prev.hash == digest and not sideloaded:
        stats.unchanged += 1
        return keep(prev)
    if sig is None and prev is not None and lsh.hashable(info.dtype) and prev.hash == digest:
        sig, got.squares = lsh.signed(arr)  # same bytes but side-loaded: the reader skipped it

    cached: list = []
    checking: list = []  # the hash of the rebuilt previous value, computed on the hash thread meanwhile

    def previous_value() -> np.ndarray | None:
        if prev is None:
            return None
        if not cached:
            try:
                # its final hash is checked on another thread while it is compared with / encoded against
                # (check_previous() before anything built on it is returned)
                value = decode_proven_dense(prev, store, path)  # bound and checksummed: no hash needed
                if value is None:
                    # a chain this store built and bound (bind_steps) rebuilds without hashing its steps
                    value, proven = reconstruct_proven(prev, store, path)
                    if not proven:
                        checking.append(parallel.pool("hash").submit(content_hash, value, prev.hash))
                cached.append(value)
            except BlobMissingError:
                cached.append(None)  # not fetched locally: cannot compare or build on it
            except (IntegrityError, MetadataError) as e:
                # the committed version is broken (corrupt store, forged metadata): the new value is stored
                # on its own; the add (and `git status`, which cleans too) must not fail because of the old one
                stats.warnings.append(f"{key}: previous version unusable ({e}); stored anew")
                cached.append(None)
        return cached[0]

    def check_previous() -> None:
        if checking and checking.pop().result() != prev.hash:
            raise UpdateTypeError(f"{path}: group {key!r}: its previous version rebuilt from the store does not "
                                  f"match its content hash (corrupt object?)")

    if got.frames is not None:
        steps = _clean_streamed(got, store, same_lsh, options, stats, path, previous_value, check_previous,
                                checking.append)
        if steps is None:
            return keep(prev)
        return _written(got, steps, got.sig, store, stats, 0)

    if prev is not None and dt.is_float and not options.exact and not sideloaded:
        maybe = lsh.maybe_close(sig, prev.lsh if same_lsh else None, arr.size,
                                math.sqrt(got.squares) if sig is not None and prev.lsh is not None else 0.0,
                                options.rtol, options.atol)
        if maybe:
            old = previous_value()
            if old is not None and numeric.allclose(arr, old, options.rtol, options.atol):
                check_previous()
                stats.close += 1
                return keep(prev)

    # a change encoded on the previous split keyframe rebuilds the previous value frame by frame, not whole: the
    # norms of the change are measured there, frame by frame (as a group cleaned frame by frame measures them)
    beside: dict[int, tuple[int, float, int]] = {}  # frame start -> (elements, Σ of the change's squares, changed)
    flat = arr.reshape(-1) if prev is not None and norms.measurable(info.dtype) else None

    def measure_beside(a: int, b: int, words: np.ndarray) -> None:  # on the codec threads
        was = words.view(flat.dtype)
        beside[a] = (b - a, norms.change_squares(flat[a:b], was), norms.changed_count(flat[a:b], was))

    before = store.written_bytes
    try:
        steps = encode_changed_group(key, arr, digest, prev, previous_value, store, options, update_data,
                                     reshaped_previous=got.reshaped,
                                     on_previous=measure_beside if flat is not None else None)
    except BaseException:
        for fut in checking:
            fut.cancel() or fut.exception()  # never leave the hasher reading a freed value
        raise
    check_previous()
    if norms.measurable(info.dtype):
        # measured against the previous value where it was the base of the encoding (as frame by frame), not
        # where it was only compared (allclose): the text is the same whichever path cleaned the group
        base = cached[0] if (cached and prev is not None and prev.dtype == info.dtype and options.update_type != "dense"
                             and not chain_full(prev, options.max_chain)) else None
        if base is not None and base.shape != arr.shape:
            base = None
        # the value's sum of squares came with its signature; the change's is one pass over both values, or the
        # frames of the previous value a rebase on its split keyframe rebuilt beside, summed in order
        got.sums = norms.Sums(got.squares if got.squares is not None else lsh.squares(arr))
        rebased = base is None and sum(n for n, _, _ in beside.values()) == arr.size > 0
        if base is not None:
            got.sums.change, got.sums.changed = norms.change_squares(arr, base), norms.changed_count(arr, base)
        elif rebased:
            for a in sorted(beside):
                got.sums.change += beside[a][1]
                got.sums.changed += beside[a][2]
        got.base = prev.hash if base is not None or rebased else None
    return _written(got, steps, sig, store, stats, store.written_bytes - before)


def _written(got: _Read, steps: list[Step], sig, store: LfsStore, stats: CleanStats, new_bytes: int) -> GroupMeta:
    """The metadata of a group stored as ``steps`` (checked), its chain bound in ``store``."""
    # every step's value is now proven (hashed here, or bound before); the blobs not of an earlier chain are
    # the ones this clean encoded
    earlier = {s.blob.oid for p in (got.prev, got.reshaped) if p is not None for s in p.steps}
    bind_steps(steps, store, encoded={s.blob.oid for s in steps} - earlier)
    stats.written += 1
    stats.by_type[steps[-1].type] = stats.by_type.get(steps[-1].type, 0) + 1
    stats.new_blob_bytes += new_bytes
    info = got.info
    return GroupMeta(name=got.key, dtype=info.dtype, shape=tuple(info.shape), hash=got.digest, steps=steps,
                     lsh=sig, is_parameter=info.is_parameter, requires_grad=info.requires_grad, fast=got.fast,
                     norms=_recorded_norms(got))


def _recorded_norms(got: _Read) -> Norms | None:
    """The norms of a group stored anew (theta.model.norms): its value's, and its change from ``got.base`` when that
    value was measured too; None when not measured, or not finite (NaN, Inf)."""
    s = got.sums
    if s is None or not norms.finite(s):
        return None
    if got.base is None:
        return Norms(value=norms.rounded(math.sqrt(s.value)))
    return Norms(value=norms.rounded(math.sqrt(s.value)), source=got.base,
                 change=norms.rounded(math.sqrt(s.change)), changed=s.changed)


def _clean_streamed(got: _Read, store: LfsStore, same_lsh: bool, options: CleanOptions, stats: CleanStats,
                    path: str, previous_value: Callable[[], np.ndarray | None],
                    check_previous: Callable[[], None], on_check: Callable) -> list[Step] | None:
    """:func:`_clean_group`'s decisions for a group cleaned frame by frame (theta.model.framewise): its steps, or
    None when it is unchanged or close to its previous version (``got``'s digest, fast hash and signature are
    set either way). The stored bytes are counted in ``stats.new_blob_bytes`` here."""
    frames, prev = got.frames, got.prev
    auto = options.update_type == "auto"
    delta_base = prev is not None and auto and not chain_full(prev, options.max_chain)
    split = keyframe.split_op(frames.dtype, frames.size * frames.item) if auto else None
    before = store.written_bytes
    with ExitStack() as stack:
        def previous_frames():
            return stack.enter_context(framewise.previous_frames(prev, store, path, frames.bounds, previous_value,
                                                                 on_check))

        old = previous_frames() if delta_base else None
        first = framewise.first_pass(frames, old, options.level, store, high_op=split)
        try:
            got.digest, got.fast, got.sig = first.digest, first.fast, first.sig
            if got.sent is not None and got.sent != first.fast:
                raise FileChanged(f"{path}: group {got.key!r} changed while git was reading the file; "
                                  f"run the git command again")
            if prev is not None and prev.hash == first.digest:
                first.staged.discard()
                stats.unchanged += 1
                return None
            if prev is not None and not options.exact and lsh.maybe_close(
                    first.sig, prev.lsh if same_lsh else None, frames.size,
                    first.norm if first.sig is not None and prev.lsh is not None else 0.0, options.rtol, options.atol):
                old = old if delta_base else previous_frames()
                if old is not None and framewise.allclose(frames, old, options.rtol, options.atol):
                    check_previous()
                    first.staged.discard()
                    stats.close += 1
                    return None
            got.sums, got.base = first.sums, (prev.hash if first.kind == "delta" else None)
            if first.kind == "high":
                steps = keyframe.split_keyframe(framewise.words(frames), first.digest, store, options.level,
                                                high=(first.staged, first.high_hash))
            elif first.kind == "dense":
                steps = [store_staged("dense", first.staged, {}, first.digest, store)]
            else:  # a delta against the previous value: only auto has one
                steps = _streamed_auto(first, frames, old, prev, store, options, path, stats, check_previous)
            check_previous()
        except BaseException:
            first.staged.discard()
            raise
    stats.new_blob_bytes += store.written_bytes - before
    return steps


def _streamed_auto(first, frames, old, prev: GroupMeta, store: LfsStore, options: CleanOptions, path: str,
                   stats: CleanStats, check_previous: Callable[[], None]) -> list[Step]:
    """auto's chain for a group cleaned frame by frame whose first pass staged its delta against the previous
    value (``first``): a step appended to the previous chain when the chain still fits the keyframe budget
    (theta.updates.keyframe), else a rebased or self-contained chain (the previous value is then not needed)."""
    budget = keyframe.Budget(dense_estimate(first.sample, frames.size, options.level), options.keyframe_ratio)
    src = framewise.words(frames)
    split = keyframe.split_op(frames.dtype, frames.size * frames.item)
    if budget.append_may_fit(prev, lambda: first.staged.size):
        choice = framewise.best_change(first, frames, old, options.level, store)
        if choice.update_type == "dense":  # self-contained anyway: auto's keyframe
            if split is None:
                return [store_staged("dense", choice.staged, {}, first.digest, store)]
            choice.staged.discard()
            check_previous()
            return keyframe.split_keyframe(src, first.digest, store, options.level)
        if budget.fits(keyframe.fetch_bytes(prev.steps) + choice.size):
            return [*prev.steps, store_staged(choice.update_type, choice.staged, choice.params, first.digest, store)]
        choice.staged.discard()
    else:
        first.staged.discard()
    check_previous()
    return keyframe.without_append(src, first.digest, prev, store, budget, options.level, path, stats.warnings)
