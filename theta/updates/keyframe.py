"""Keyframes: a fresh checkout of any version fetches little more than that version alone would cost.

A group's value is a chain of steps from a self-contained first one. A checkout whose previous version is local
(a pull) fetches only the new step; a fresh one (a clone) fetches every blob of the chain. Chains that only grow
(base, then a step per fine-tune) make the clone pay for the whole history. The policy here, applied by
``auto`` when a changed group is stored (:func:`theta.updates.auto.encode_change`), keeps every chain's
*fetch size* (the bytes of its distinct blobs) within ``ratio`` x what storing the new value self-contained
costs (``theta.keyframeRatio``, default :data:`DEFAULT_RATIO`):

1. **append** a step after the previous version's chain (sparse, delta...: the smallest), when that chain with
   the step still fits;
2. else **rebase**: when the previous chain is a split keyframe (below), keep its first step and store the new
   value as one split step on it -- a two-step chain, however many versions came before;
3. else store a **keyframe**: the value self-contained.

A *split keyframe* is how a float32 / float64 group of :data:`SPLIT_MIN_BYTES` or more is stored
self-contained: a dense step holding only the high bits of each element (the top 14: sign, exponent and the
top mantissa bits -- 5 of float32's, 2 of float64's; its low bits are zero and cost nothing), then a ``delta``
step of op ``split18`` / ``split50`` holding the low bits as they are (:mod:`theta.updates.delta`). Both blobs
together cost what one dense blob costs. A fine-tune moves the low bits of nearly every weight and the high
bits of few, so the next version is one split step on the same first step: its low bits, and its high bits'
(mostly zero) difference from the first step's. A pull fetches that step (~0.57 of the raw bytes for a
float32 fine-tune, where the delta on the previous version costs ~0.51); a clone fetches the first step and
that step, ~0.85 of the raw bytes (1.01 dense blobs), where appending deltas made it 0.835 + 0.51 per
fine-tune. The high bits drift as training goes on; when the rebased chain no longer fits, a new keyframe
starts. (Where to split: ``scripts/bench/keyframes.py --bits``; fewer low bits make pulls smaller and clones
larger, the high bits' change costing more.)

What "self-contained costs" is estimated from a sample of the value (the estimate auto uses for dense,
:func:`theta.updates.auto.dense_estimate`); the chains' sizes are exact (their blobs are staged before any is
kept).
"""
from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

import numpy as np

from theta.base import valuehash
from theta.base.errors import ChainError, IntegrityError, UpdateTypeError
from theta.storage import codec
from theta.storage.metadata import GroupMeta, Step
from theta.storage.store import LfsStore, Staged, stage_chunks
from theta.updates.delta import _uncombine, combine, raw_words, split_bits
from theta.updates.rebuild import is_split_chain
from theta.updates.steps import store_dense, store_staged, store_step

DEFAULT_RATIO = 1.25
# a smaller group is stored self-contained as one dense blob: its two blobs would cost more in requests
# (an LFS batch entry and a download each) than its chains can save
SPLIT_MIN_BYTES = 256 << 10
# a sampled step estimate may overstate the step by this much before an append is not tried
APPEND_SLACK = 0.9
_SPLIT_OPS = {4: "split18", 8: "split50"}  # word size -> op: the high part keeps 14 bits (sign, exponent, mantissa)


def split_op(dtype: np.dtype, nbytes: int) -> str | None:
    """The split op of a group of ``dtype`` and ``nbytes`` stored as a split keyframe, or None (stored dense)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or nbytes < SPLIT_MIN_BYTES:
        return None
    return _SPLIT_OPS.get(dtype.itemsize)


def fetch_bytes(chain: list[Step]) -> int:
    """Bytes a checkout with none of the chain's blobs local fetches for it (each distinct blob once)."""
    return sum({s.blob.oid: s.blob.size for s in chain}.values())


@dataclass(frozen=True)
class Budget:
    """The most a chain may fetch for one value: ``ratio`` x its estimated self-contained size."""

    self_contained: float
    ratio: float

    @property
    def limit(self) -> float:
        return self.ratio * self.self_contained

    def fits(self, chain_bytes: float) -> bool:
        return chain_bytes <= self.limit

    def append_may_fit(self, previous: GroupMeta, step_estimate: Callable[[], float | None]) -> bool:
        """Whether a step appended after ``previous``'s chain may fit: surely when even a step as large as the
        value fits, never when the chain alone does not; else by ``step_estimate()`` (sampled, None when it
        cannot say: the real step is encoded when this says yes, and the decision made on its size)."""
        before = fetch_bytes(previous.steps)
        if before + self.self_contained <= self.limit:
            return True
        if before >= self.limit:
            return False
        estimate = step_estimate()
        return estimate is None or before + APPEND_SLACK * estimate <= self.limit


def masks(words: np.dtype, op: str) -> tuple[np.generic, np.generic]:
    """(high, low) bit masks of ``op``'s split of ``words``."""
    bits = split_bits(op, words)
    width = np.dtype(words).itemsize * 8
    low = (1 << bits) - 1
    return np.dtype(words).type(((1 << width) - 1) ^ low), np.dtype(words).type(low)


@dataclass(frozen=True)
class Words:
    """A value's raw words (:func:`theta.updates.delta.raw_words`) by ranges, readable from any thread: a value
    in memory, or a group read frame by frame from the work-tree file (theta.framewise)."""

    dtype: np.dtype          # the value's dtype
    shape: tuple
    read: Callable[[int, int], np.ndarray]  # words [a, b) of the flattened value

    @staticmethod
    def of(value: np.ndarray) -> "Words":
        words = raw_words(value)
        return Words(value.dtype, tuple(value.shape), lambda a, b: words[a:b])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def word(self) -> np.dtype:
        return raw_words(np.empty(0, self.dtype)).dtype

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _stage(store: LfsStore | None, parts: dict, level: int) -> Staged:
    chunks = codec.iter_encode_parts(parts, level)
    return store.stage(chunks) if store is not None else stage_chunks(chunks)


class InOrder:
    """The value hash of frames produced on the codec threads, taken in order (``after``, the codec's callback)
    from what ``keep`` stored (each frame's words, popped once hashed)."""

    def __init__(self, like: str | None = None):
        self.h = valuehash.new() if like is None else valuehash.like(like)
        self.frames: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()

    def keep(self, start: int, frame: np.ndarray) -> None:
        with self.lock:
            self.frames[start] = frame

    def after(self, start: int, stop: int) -> None:
        with self.lock:
            frame = self.frames.pop(start)
        self.h.update(frame)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def high_part(src: Words, op: str, hashed: InOrder | None = None) -> codec.LazyArray:
    """The dense first step's value of a split keyframe, frame by frame: ``src`` with its low bits cleared
    (``hashed`` keeps each frame, to hash it in order)."""
    high, _ = masks(src.word, op)

    def read(a: int, b: int) -> np.ndarray:  # on the codec threads
        frame = np.bitwise_and(src.read(a, b), high)
        if hashed is not None:
            hashed.keep(a, frame)
        return frame.view(src.dtype)

    return codec.LazyArray(src.dtype, src.shape, read, after=hashed.after if hashed is not None else None)


def low_codes(src: Words, op: str) -> codec.LazyArray:
    """The split step of a keyframe on its own high part: the low bits of each word (the high bits' difference
    is zero)."""
    _, low = masks(src.word, op)
    return codec.LazyArray(src.word, (src.size,), lambda a, b: np.bitwise_and(src.read(a, b), low), planes=True)


def split_keyframe(value: "np.ndarray | Words", value_hash: str, store: LfsStore,
                   level: int = codec.DEFAULT_LEVEL, high: tuple[Staged, str] | None = None) -> list[Step] | None:
    """``value`` stored as a split keyframe (module docstring): [dense high part, split step of its low bits],
    streamed frame by frame (no copy of the value); None when its dtype or size is not split. ``high``: the
    dense high part already staged, and its value's hash (a frame pass made it)."""
    src = value if isinstance(value, Words) else Words.of(value)
    op = split_op(src.dtype, src.nbytes)
    if op is None:
        return None
    if high is None:
        hashed = InOrder()
        high = (_stage(store, {"values": high_part(src, op, hashed)}, level), None)
        high = (high[0], hashed.hexdigest())
    try:
        codes = _stage(store, {"codes": low_codes(src, op)}, level)
    except BaseException:
        high[0].discard()
        raise
    return [store_staged("dense", high[0], {}, high[1], store), store_staged("delta", codes, {"op": op}, value_hash,
                                                                              store)]


@dataclass
class Rebased:
    """A value encoded as a split step on a chain's first step (:func:`rebase`), staged, not yet kept."""

    base: Step
    staged: Staged
    op: str
    changed: int | None = None  # elements whose bits differ from the previous version's, when counted

    @property
    def fetch_bytes(self) -> int:
        return self.base.blob.size + self.staged.size

    def keep(self, value_hash: str, store: LfsStore) -> list[Step]:
        return [self.base, store_staged("delta", self.staged, {"op": self.op}, value_hash, store)]

    def discard(self) -> None:
        self.staged.discard()


def rebase(new: "np.ndarray | Words", previous: GroupMeta, store: LfsStore, level: int = codec.DEFAULT_LEVEL,
           file: str | None = None, count: bool = False,
           beside: Callable[[int, int, np.ndarray], None] | None = None) -> Rebased | None:
    """``new`` encoded as a split step on the first step of ``previous``'s split chain (None when its chain is
    not one, or the new value has another dtype or size). The first step's value is decoded frame by frame
    from its blob (nothing group-sized is held besides ``new``) and, unless this store has proven that blob,
    hashed as it goes: a blob that does not give the value its step names raises ChainError. ``count``: also
    count the elements that differ from the previous version, rebuilt frame by frame beside (``changed``; a
    count only: a step built on the previous value is built from its checked value), and hand each range of
    it to ``beside(start, stop, previous words)`` on the codec threads (the norms of the change: theta.model)."""
    if not is_split_chain(previous):
        return None
    src = new if isinstance(new, Words) else Words.of(new)
    base, op = previous.steps[0], str(previous.steps[1].params["op"])
    try:
        split_bits(op, src.word)
    except UpdateTypeError:
        return None
    with ExitStack() as stack:
        blob = stack.enter_context(store.mapped(base.blob, group=previous.name, file=file))
        parts = codec.part_blobs(blob)
        if set(parts) != {"values"}:
            raise ChainError(f"group {previous.name!r}: its keyframe's dense blob {base.blob.oid} holds "
                             f"{sorted(parts)}", file=file, group=previous.name, oid=base.blob.oid)
        # bound: every frame carries a checksum (theta.updates.rebuild.bind_steps), required as each is decoded
        proven = store.bound(base.blob.oid, base.hash)
        plan = codec.frame_plan(parts["values"], checksums=proven)
        if plan.dtype != src.dtype or int(np.prod(plan.shape, dtype=np.int64)) != src.size:
            return None
        starts = {job[0] // plan.item: job for job in plan.jobs}
        aligned = [(a, b - a) for a, b in codec.frame_bounds(src.size, src.dtype.itemsize)] == \
            [(j[0] // plan.item, j[1]) for j in plan.jobs]
        whole = None if aligned else raw_words(codec.decode_array(parts["values"], max_bytes=plan.nbytes,
                                                                  checksums=proven))
        hashed = None if proven else InOrder(like=base.hash)
        previous_codes = _codes_reader(stack, previous, store, file, src) if count else None
        changed: dict[int, int] = {}

        def codes(a: int, b: int) -> np.ndarray:  # on the codec threads
            if whole is not None:
                base_words = whole[a:b]
            else:
                base_words = codec.decode_frame(parts["values"], plan, starts[a]).view(src.word)
            if hashed is not None:
                hashed.keep(a, base_words)
            new_words = src.read(a, b)
            if previous_codes is not None:
                was = _uncombine(previous_codes(a, b), base_words, op)
                changed[a] = int(np.count_nonzero(was != new_words))
                if beside is not None:
                    beside(a, b, was)
            return combine(new_words, base_words, op)

        staged = _stage(store, {"codes": codec.LazyArray(src.word, (src.size,), codes, planes=True,
                                                          after=hashed.after if hashed is not None else None)},
                        level)
    if hashed is not None and hashed.hexdigest() != base.hash:
        staged.discard()
        raise ChainError(f"group {previous.name!r}: its keyframe's dense blob {base.blob.oid} does not give the "
                         f"value {base.hash}", file=file, group=previous.name, oid=base.blob.oid)
    return Rebased(base, staged, op, sum(changed.values()) if count else None)


def _codes_reader(stack: ExitStack, previous: GroupMeta, store: LfsStore, file: str | None, src: Words):
    """The code words of ``previous``'s split step by ranges (its blob mapped for the ``stack``'s life)."""
    step = previous.steps[1]
    blob = stack.enter_context(store.mapped(step.blob, group=previous.name, file=file))
    parts = codec.part_blobs(blob)
    if set(parts) != {"codes"}:
        raise ChainError(f"group {previous.name!r}: its split step's blob {step.blob.oid} holds {sorted(parts)}",
                         file=file, group=previous.name, oid=step.blob.oid)
    reader = codec.ArrayReader(parts["codes"])
    if reader.dtype != src.word or reader.size != src.size:
        raise ChainError(f"group {previous.name!r}: its split step holds {reader.size} x {reader.dtype}",
                         file=file, group=previous.name, oid=step.blob.oid)
    return lambda a, b: codec.ArrayReader(parts["codes"]).read(a, b)  # a reader per call: any thread


def without_append(new: "np.ndarray | Words", new_hash: str, previous: GroupMeta | None, store: LfsStore,
                   budget: Budget | None, level: int = codec.DEFAULT_LEVEL, file: str | None = None,
                   warnings: list | None = None) -> list[Step]:
    """The chain of a changed value when no step appended to its previous chain fits: rebased on the previous
    split keyframe when that fits ``budget``, else a keyframe (split when the value is split, else dense)."""
    if previous is not None and budget is not None:
        try:
            r = rebase(new, previous, store, level, file)
        except (ChainError, IntegrityError) as e:  # the base is unusable: a keyframe does not need it
            if warnings is not None:
                warnings.append(f"{previous.name}: previous keyframe unusable ({e}); stored anew")
            r = None
        if r is not None:
            if budget.fits(r.fetch_bytes):
                return r.keep(new_hash, store)
            r.discard()
    kept = split_keyframe(new, new_hash, store, level)
    if kept is not None:
        return kept
    if isinstance(new, Words):
        lazy = codec.LazyArray(new.dtype, new.shape, lambda a, b: new.read(a, b).view(new.dtype))
        return [store_step("dense", {"values": lazy}, {}, new_hash, store, level)]
    return [store_dense(new, store, level, new_hash)]
