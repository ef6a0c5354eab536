"""Rebuilding a group's value from its chain of steps (:func:`reconstruct`), checked against its name.

The chain is bounded before any blob is read (:mod:`theta.updates.bounds`); each step's blob is decoded by its
update type (:func:`theta.updates.get`) and the result is checked against the value's recorded name.
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Container

import numpy as np

from zipslice import dtypes

from theta.base.errors import ChainError, IntegrityError, MetadataError, UpdateTypeError
from theta.storage import codec
from theta.storage.codec import decode_parts, part_blobs
from theta.updates import bounds, content_hash, get, step_layout
from theta.updates.bounds import where
from theta.updates.delta import _uncombine, raw_words
from theta.updates.rows import apply_grown

if TYPE_CHECKING:
    from theta.storage.codec import FramePlan
    from theta.storage.metadata import GroupMeta
    from theta.storage.store import LfsStore


# incremental steps whose value is a pure function of the previous value and their decoded parts (bit for bit)
TRUSTED_INCREMENTAL = ("delta", "sparse", "rows")


@contextmanager
def _dense_frames(group: "GroupMeta", store: "LfsStore", file: str | None = None, proven_only: bool = True):
    """The value of a group whose chain is one dense step, as frames to decode one by one -- the checks of
    :func:`decode_proven_dense`, all made before any frame is decoded: the blob holds exactly one part,
    ``values``, of the group's dtype and shape; for a blob that proves its own bytes, also: the store binds it to
    the group's hash (:func:`bind_steps`: a blob is bound only when every zstd frame carries a checksum; each is
    required and verified as its frame is decoded, :func:`theta.storage.codec.decode_frame`). Yields ``(values
    blob, codec.FramePlan, proven)`` while the blob is mapped, or None (the caller rebuilds the value another
    way; ``proven_only``: also when not proven). Structural errors raise, located."""
    if len(group.steps) != 1 or group.steps[0].type != "dense":
        yield None
        return
    step = group.steps[0]
    bound = store.bound(step.blob.oid, group.hash)
    if proven_only and not bound:
        yield None
        return
    with store.mapped(step.blob, group=group.name, file=file) as blob:
        try:
            plan = None
            if bound or not proven_only:
                parts = codec.part_blobs(blob)
                if set(parts) == {"values"}:
                    values = parts["values"]
                    plan = codec.frame_plan(values, checksums=bound)
        except IntegrityError as e:
            raise bounds_located(e, file, group.name, step.blob.oid) from None
        if plan is None or plan.dtype != dtypes.get(group.dtype).to_numpy() or \
                tuple(plan.shape) != tuple(group.shape) or plan.nbytes != group.numel * plan.item:
            yield None
            return
        yield values, plan, bound


_scratch = threading.local()  # per codec thread: the buffer a split step's codes are decoded into


@dataclass(frozen=True)
class ChainFrames:
    """A value to decode frame by frame (:func:`chain_frames`): the frames of ``plan`` (its ``jobs``), each decoded
    by ``decode(job, out, high=None)`` into the value's little-endian bytes (a uint8 array; in ``out``, a reused
    buffer, when it is large enough). For a split keyframe chain (``split``), ``high`` (a uint8 buffer of a
    frame's size) also receives that frame of the first step's value, for a caller hashing both steps' values.
    ``proven``: the store proves the blobs (bound here, every frame checksummed and verified while decoding): the
    value needs no hash; else the caller hashes it (and, for a split chain, its first step's) as frames pass."""

    plan: "FramePlan"
    decode: "Callable[..., np.ndarray]"
    proven: bool
    split: bool = False


def is_split_chain(group: "GroupMeta") -> bool:
    """A split keyframe chain (theta.updates.keyframe): a dense step, then one delta step of a split op."""
    steps = group.steps
    return (len(steps) == 2 and steps[0].type == "dense" and steps[1].type == "delta"
            and str(steps[1].params.get("op", "")).startswith("split"))


def chain_bound(group: "GroupMeta", store: "LfsStore") -> bool:
    """Whether this store has proven every step of a chain :func:`chain_frames` can stream (one dense step, or
    a split keyframe chain) -- cheap: the blobs are not opened."""
    steps = group.steps
    if len(steps) == 1 and steps[0].type == "dense":
        return store.bound(steps[0].blob.oid, group.hash)
    return (is_split_chain(group) and steps[1].hash == group.hash and store.bound(steps[0].blob.oid, steps[0].hash)
            and store.bound(steps[1].blob.oid, step_binding(steps[0].hash, group.hash)))


@contextmanager
def chain_frames(group: "GroupMeta", store: "LfsStore", file: str | None = None, proven_only: bool = True):
    """The frames of a chain that decodes frame by frame: one dense step (:func:`_dense_frames`), or a split
    keyframe chain whose two blobs are cut into the same frames (each frame of the value: the high part's frame,
    its split codes' applied in place). Yields a :class:`ChainFrames`, or None (the caller rebuilds the value
    another way); ``proven_only``: None also for a chain the store does not prove (both steps bound here, both
    blobs checksummed frame by frame: :func:`bind_steps`)."""
    if not is_split_chain(group):
        with _dense_frames(group, store, file, proven_only) as dense:
            if dense is None:
                yield None
                return
            values, plan, proven = dense
            yield ChainFrames(plan, lambda job, out, high=None: codec.decode_frame(values, plan, job, out=out), proven)
        return
    bound = chain_bound(group, store)
    if proven_only and not bound:
        yield None
        return
    high, split = group.steps
    if split.hash != group.hash:
        yield None
        return
    want = dtypes.get(group.dtype).to_numpy()
    with store.mapped(high.blob, group=group.name, file=file) as hblob, \
            store.mapped(split.blob, group=group.name, file=file) as sblob:
        try:
            hparts, sparts = codec.part_blobs(hblob), codec.part_blobs(sblob)
            ok = set(hparts) == {"values"} and set(sparts) == {"codes"} and (bound or not proven_only)
            hplan = codec.frame_plan(hparts["values"], checksums=bound) if ok else None
            splan = codec.frame_plan(sparts["codes"], checksums=bound) if ok else None
        except IntegrityError as e:
            raise bounds_located(e, file, group.name, high.blob.oid) from None
        word = raw_words(np.empty(0, want)).dtype
        if (hplan is None or hplan.dtype != want or tuple(hplan.shape) != tuple(group.shape)
                or hplan.nbytes != group.numel * hplan.item or splan.dtype != word
                or [(j[0], j[1]) for j in hplan.jobs] != [(j[0], j[1]) for j in splan.jobs]):
            yield None
            return
        op, codes_of = split.params["op"], {j[0]: j for j in splan.jobs}

        def decode(job, out, high=None):  # on the codec threads: a buffer for the codes each
            frame = codec.decode_frame(hparts["values"], hplan, job, out=out)
            if high is not None:
                high[:frame.nbytes] = frame
            words = frame.view(word)
            cjob = codes_of[job[0]]
            buf = getattr(_scratch, "codes", None)
            if buf is None or buf.nbytes < cjob[1] * splan.item:
                buf = _scratch.codes = np.empty(max(codec.FRAME_BYTES, cjob[1] * splan.item), np.uint8)
            codes = codec.decode_frame(sparts["codes"], splan, cjob, out=buf)
            _uncombine(codes.view(word), words, op, out=words, scratch=True)
            return frame

        yield ChainFrames(hplan, decode, bound, split=True)


def bounds_located(e: IntegrityError, file: str | None, group: str, oid: str) -> IntegrityError:
    """``e`` prefixed with where it happened (file, group, the dense step's blob)."""
    return bounds.located(e, file, group, 0, oid)


def decode_proven_dense(group: "GroupMeta", store: "LfsStore", file: str | None = None) -> np.ndarray | None:
    """The value of a group whose chain is one dense step, when its blob proves its own bytes (the checks of
    :func:`_dense_frames`: every zstd frame carries a checksum, verified while decoding, and the store has
    bound the blob to the group's hash -- :meth:`LfsStore.bind`: theta encoded, or hashed, that value on this
    machine), decoded whole. None otherwise (the caller rebuilds and hashes the value). Bad frames raise,
    located."""
    with _dense_frames(group, store, file) as proven:
        if proven is None:
            return None
        values, plan, _ = proven
        try:
            # raises CodecError on a bad checksum or structure; the plan was checked against the group's bytes
            return codec.decode_array(values, max_bytes=plan.nbytes, checksums=True)
        except IntegrityError as e:
            raise bounds_located(e, file, group.name, group.steps[0].blob.oid) from None


def step_binding(base_hash: str, value_hash: str) -> str:
    """What an incremental step's blob is bound to (:meth:`LfsStore.bind`): the pair (hash of the value it
    applies to, hash of the value it gives), as one sha256, so a binding never vouches for the blob applied to
    another base."""
    return hashlib.sha256(f"theta-step\0{base_hash}\0{value_hash}".encode()).hexdigest()


def bind_steps(steps: list, store: "LfsStore", encoded: Container[str] = ()) -> None:
    """Record, for a chain theta has just built and checked on this machine, that each step's blob gives its
    step's value (dense: that value; incremental: that value from the step before's): later rebuilds on this
    machine may then trust those blobs' frame checksums instead of hashing the values
    (:func:`reconstruct` with ``trust_bound``).

    A blob is bound only when every zstd frame of it carries a checksum, so a binding alone says a rebuild
    may trust the blob's frames, and no rebuild reads every frame's header first: blobs theta encoded
    (``encoded``: their oids; theta's encoder always writes checksums) are bound as they are, any other (a
    fetched blob whose value was just hashed) once its frames are checked here."""
    for i, step in enumerate(steps):
        key = _binding_key(step, steps[i - 1].hash if i else None)
        oid = step.blob.oid
        if key is None or store.bound(oid, key):
            continue
        if oid not in encoded:
            with store.mapped(step.blob) as blob:
                if not codec.frames_checksummed(blob):
                    continue
        store.bind(oid, key)


def _binding_key(step, base_hash: str | None) -> str | None:
    """What ``step``'s blob is bound to: its value's name for a first step (no ``base_hash``), the pair of names
    for a trusted incremental one (:func:`step_binding`); None for a step no binding can vouch for."""
    if base_hash is None:
        return step.hash
    return step_binding(base_hash, step.hash) if step.type in TRUSTED_INCREMENTAL else None


def _bound(step, base_hash: str | None, store: "LfsStore") -> bool:
    """True when this store bound ``step``'s blob to its value (and base): theta encoded or hashed it here,
    and every frame of it has a checksum (:func:`bind_steps`)."""
    key = _binding_key(step, base_hash)
    return key is not None and store.bound(step.blob.oid, key)


def chain_proven(group: "GroupMeta", store: "LfsStore") -> bool:
    """Whether this store proves every step of ``group``'s chain (:func:`bind_steps`: bound here, so every
    frame checksummed) up to the group's own value: its value needs no hashing (as :func:`reconstruct_proven`
    decides while rebuilding), without opening a blob."""
    steps = group.steps
    if not steps or steps[-1].hash != group.hash:
        return False
    return all((not i or step.type in TRUSTED_INCREMENTAL) and _bound(step, steps[i - 1].hash if i else None, store)
               for i, step in enumerate(steps))


def reconstruct(group: "GroupMeta", store: "LfsStore", cache: dict | None = None,
                file: str | None = None, verify: bool = True) -> np.ndarray:
    """The value of ``group``: walk its steps from the last cached one, checking every step's hash.

    ``cache`` maps content hash -> array for one checkout/merge (callers decide what to keep in it);
    the result is added to it. Memory: the previous value, one step's parts, and the new value; a type with
    ``apply_blob(blobs, params, previous, in_place)`` (delta, sparse) streams its step from the blob and updates
    a value this function owns in place, so a chain of such steps costs one value and a few frames.
    ``verify=False`` skips only the check of the final value (the caller checks it, e.g. smudge hashes it
    on another thread while writing); intermediate values of a chain are always checked.
    Each step's value has the dtype/shape :func:`step_layout` gives (a chain may cross a change of shape).

    The chain is checked first (:func:`theta.updates.bounds.check_group`: known step types, a
    self-contained first step, bounded work) and each step's parts are bounded before they are decoded;
    every error names ``file``, the group, the step and its blob (ChainError, CodecError, BlobCorruptError).
    """
    return _rebuild(group, store, cache, file, verify, False)[0]


def reconstruct_proven(group: "GroupMeta", store: "LfsStore", file: str | None = None) -> tuple[np.ndarray, bool]:
    """:func:`reconstruct` without hashing what this store proves: a value every step of whose chain so far
    is bound here (:func:`bind_steps`) and has checksummed frames (verified while decoding), from the dense
    first step, is not hashed (as a checkout trusts frames in "frames" mode). Returns (value, proven):
    when not proven, the final value was NOT checked and the caller must hash it."""
    value, proven = _rebuild(group, store, None, file, False, True)
    return value, proven and bool(group.steps) and group.steps[-1].hash == group.hash


def _rebuild(group: "GroupMeta", store: "LfsStore", cache: dict | None, file: str | None, verify: bool,
             trust_bound: bool) -> tuple[np.ndarray, bool]:
    steps = group.steps
    bounds.check_group(group, file)
    start, value = 0, None
    if cache is not None:
        for i in range(len(steps) - 1, -1, -1):
            hit = cache.get(steps[i].hash)
            if hit is not None:
                # equal bytes may be cached under another group's dtype/shape: take this step's own
                dtype_name, shape = step_layout(steps[i], group)
                if hit.dtype != dtypes.get(dtype_name).to_numpy() or hit.size != int(np.prod(shape, dtype=np.int64)):
                    continue
                start, value = i + 1, hit if tuple(hit.shape) == shape else hit.reshape(shape)
                break
    last = len(steps) - 1
    shared = value  # a cached value belongs to the cache: never updated in place
    proven = trust_bound and start == 0  # a cached value's origin is not known here
    room = _room(steps, group) if value is None else None
    for i, step in enumerate(steps[start:], start=start):
        ut = get(step.type)
        if value is None and ut.incremental:
            raise MetadataError(f"group {group.name!r}: step {step.type!r} needs a previous value but is first")
        oid = step.blob.oid
        out_bytes = bounds.layout_bytes(step, group)
        budget = bounds.parts_budget(value.nbytes if value is not None else 0, out_bytes)
        streamed = getattr(ut, "apply_blob", None) if value is not None else None
        try:
            with store.mapped(step.blob, group=group.name, file=file) as blob:
                proven = proven and _bound(step, steps[i - 1].hash if i else None, store)
                parts = None
                in_room = _in_room(room, value, blob, step, group) if room is not None else None
                if in_room is not None:
                    value = in_room
                elif streamed is not None:
                    # reads the map frame by frame while applying (bounded by the value it updates); the
                    # result is fresh memory or the value itself
                    mine = shared is None or not np.may_share_memory(value, shared)
                    value = streamed(part_blobs(blob), step.params, value, in_place=mine)
                else:
                    # fresh memory: nothing points into the map
                    parts = decode_parts(blob, max_bytes=budget, checksums=proven)
            if parts is not None:
                value = ut.apply(parts, step.params, value)
                del parts
        except IntegrityError as e:
            raise bounds.located(e, file, group.name, i, oid) from None
        except UpdateTypeError as e:
            raise ChainError(f"{bounds.where(file, group.name, i, oid)}: {e}", file=file, group=group.name,
                             oid=oid) from None
        except (ValueError, TypeError, IndexError, KeyError, OverflowError, AttributeError) as e:
            # an update type meeting parts it does not expect (a forged blob): never a traceback
            raise ChainError(f"{bounds.where(file, group.name, i, oid)}: step {step.type!r} cannot be applied to "
                             f"its parts: {type(e).__name__}: {e}", file=file, group=group.name, oid=oid) from None
        dtype_name, shape = step_layout(step, group)
        want = dtypes.get(dtype_name).to_numpy()
        if not isinstance(value, np.ndarray):
            raise ChainError(f"{bounds.where(file, group.name, i, oid)}: step {step.type!r} returned "
                             f"{type(value).__name__}, not an array", file=file, group=group.name, oid=oid)
        if value.dtype != want or tuple(value.shape) != shape:
            value = _coerce(value, want, shape, group, file, i, oid)
        if (verify or i < last) and not proven and content_hash(value, like=step.hash) != step.hash:
            raise ChainError(f"{bounds.where(file, group.name, i, oid)}: step {step.type!r} rebuilt a value whose "
                             f"hash differs from the recorded {step.hash}", file=file, group=group.name, oid=oid)
    if cache is not None and value is not None:
        cache[group.hash] = value
    return value, proven


def _room(steps: list, group: "GroupMeta") -> np.ndarray | None:
    """A buffer for a chain whose value grows on the way (a ``rows`` step appending rows): the
    size of its largest value, so the first value is decoded into it and the rows step grows it in place
    instead of holding the value before and the grown one. None for any other chain."""
    if len(steps) < 2 or steps[0].type != "dense" or not any(s.type == "rows" for s in steps[1:]):
        return None
    sizes = [bounds.layout_bytes(s, group) for s in steps]
    return np.empty(max(sizes), np.uint8) if max(sizes) > sizes[0] else None


def _in_room(room: np.ndarray, value: np.ndarray | None, blob, step, group: "GroupMeta") -> np.ndarray | None:
    """The value of ``step`` built in ``room`` (a chain that grows, :func:`_room`): the first dense step decoded
    into it, or a rows step growing the value at its start in place; None when the step is applied as usual."""
    if value is None:
        return _decode_dense_into(room, blob, step, group)
    if step.type == "rows" and _prefix_of(value, room):
        return apply_grown(part_blobs(blob), step.params, room, value)
    return None


def _prefix_of(value: np.ndarray, room: np.ndarray) -> bool:
    """True when ``value`` is the C-contiguous, writable start of ``room``."""
    return (value is not None and value.flags.c_contiguous and value.flags.writeable and value.nbytes <= room.nbytes
            and value.__array_interface__["data"][0] == room.__array_interface__["data"][0])


def _decode_dense_into(room: np.ndarray, blob, step, group: "GroupMeta") -> np.ndarray | None:
    """The value of a dense step decoded frame by frame into the start of ``room``; None when the blob is not
    one ``values`` array of the step's layout (the caller decodes it as usual and reports what is wrong)."""
    blobs = part_blobs(blob)
    dtype_name, shape = step_layout(step, group)
    want = dtypes.get(dtype_name).to_numpy()
    if set(blobs) != {"values"}:
        return None
    dt, got_shape = codec.array_info(blobs["values"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * want.itemsize
    if dt != want or tuple(got_shape) != tuple(shape) or nbytes > room.nbytes:
        return None
    flat = room[:nbytes].view(want)
    for start, frame in codec.iter_decode_array(blobs["values"]):
        if start + frame.size > flat.size:
            raise ChainError(f"group {group.name!r}: dense blob holds more than its {flat.size} elements")
        flat[start:start + frame.size] = frame
    return flat.reshape(shape)


def _coerce(value: np.ndarray, want: np.dtype, shape: tuple, group: "GroupMeta", file: str | None = None,
            step: int | None = None, oid: str | None = None) -> np.ndarray:
    if value.size != int(np.prod(shape, dtype=np.int64)):
        raise ChainError(f"{where(file, group.name, step, oid)}: rebuilt {value.size} values, expected shape "
                         f"{list(shape)}", file=file, group=group.name, oid=oid)
    if value.dtype != want:
        value = value.astype(want)
    return value.reshape(shape)


# ---------------------------------------------------------------- steps whose value has another layout
# A chain may cross a change of shape (``rows``: an embedding trimmed or extended) or dtype. A step whose
# value has another dtype/shape than its group records it in its params under these keys; a step without
# them produces the group's dtype and shape (so metadata written before reads as it always did).
