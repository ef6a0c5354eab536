"""auto: per group, the smallest exact representation of a changed value.

The candidates are the exact update types: ``sparse`` (few elements changed), ``delta`` (many elements
moved a little), ``rows`` (rows removed/reordered/appended: the shape changed along the first
dimension) and ``dense`` (the value itself, always possible). Reuse of an unchanged group is decided
before this module is called (same content hash or within tolerance of the previous value).

Cheap estimates first, so that only candidates that can win are encoded in full:

- the number of changed elements ``k`` is counted from the raw bits (one pass, no compression);
  sparse is tried only when ``k`` is at most half of the elements (beyond that delta always wins:
  a sparse element costs its full value plus an index); when at least 90 % of the sample below changed,
  that pass is skipped and sparse is not tried;
- delta is encoded in full; dense is estimated from a sample (up to 16 slices of 16 Ki elements spread
  over the group, scaled to the group) and encoded in full only when that is within 10 % of delta's size;
- ``rows`` (the shape changed): dense is encoded only when more than half of the rows are new;
  when dense still wins (rows were resized AND changed in one commit), a positional ``rows`` step
  followed by sparse/delta is tried (:func:`resize_then_change`);
- every candidate that is encoded is compressed for real, streamed into a staged temp file beside the
  store (:meth:`LfsStore.stage`: a candidate costs disk, not memory; delta's code words are computed
  frame by frame while they are compressed) and the smallest is kept, the others discarded. The staged
  blob is returned, so the caller publishes it without compressing a second time.

The chosen type is recorded in the group's step, as for any explicitly requested type.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from zipslice import dtypes
from zipslice.dtypes import le_bytes

from theta.base import valuehash
from theta.base.errors import BlobMissingError, IntegrityError, MetadataError, UpdateDataError
from theta.storage import codec
from theta.storage.store import Staged, stage_chunks
from theta.updates import Encoded, content_hash, get, keyframe, relayout_steps, steps
from theta.updates.delta import OPS, changed_count, combine, raw_words, same_layout
from theta.updates.rebuild import is_split_chain, reconstruct
from theta.updates.rows import encode_sources
from theta.updates.sparse import index_dtype

# dense is estimated from 16 slices of 16 Ki elements (1 MiB of fp32) against the delta blob encoded in full.
# Larger slices would make the sample the whole group for every group up to 1 Mi elements (all attention
# matrices of a BERT), encoding a full fine-tune several times instead of once; only dense is sampled, since
# a delta of a fine-tune is ~0.6 x dense, far from the 10 % margin a smaller sample could misjudge
SAMPLE_SLICES = 16
SAMPLE_ELEMENTS = 1 << 14
DENSE_MARGIN = 1.10
MOSTLY_CHANGED = 0.9  # share of the sample's elements changed beyond which sparse is not tried (see choose)


@dataclass
class Choice:
    update_type: str            # name of the chosen update type (recorded in the Step)
    params: dict                # the Encoded params of the chosen type
    staged: Staged              # the blob (codec.iter_encode_parts of the parts), staged for the store
    tried: dict[str, int] = field(default_factory=dict)  # candidate -> blob size, for diagnostics

    @property
    def size(self) -> int:
        return self.staged.size

    @property
    def blob(self) -> bytes:
        return self.staged.read()


def sample_spans(size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of the sample of a group of ``size`` elements: up to SAMPLE_SLICES
    slices of SAMPLE_ELEMENTS spread over it (all of it when it is that small)."""
    if size <= SAMPLE_SLICES * SAMPLE_ELEMENTS:
        return [(0, size)]
    starts = np.linspace(0, size - SAMPLE_ELEMENTS, SAMPLE_SLICES).astype(np.int64)
    return [(int(s), int(s) + SAMPLE_ELEMENTS) for s in starts]


def _sample(arr: np.ndarray) -> np.ndarray:
    """The elements of :func:`sample_spans` of the flattened ``arr``, concatenated."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    spans = sample_spans(flat.size)
    if len(spans) == 1:
        return flat
    return np.concatenate([flat[a:b] for a, b in spans])


def dense_estimate(sample: np.ndarray, size: int, level: int) -> float:
    """The size of the dense blob of a value of ``size`` elements, estimated from its ``sample``
    (:func:`sample_spans`)."""
    return len(codec.encode_parts({"values": sample}, level)) * (size / max(sample.size, 1))


def dense_might_win(new: np.ndarray | int, delta_size: int, level: int, *,
                    new_sample: np.ndarray | None = None, estimate: float | None = None) -> bool:
    """Whether the dense blob of ``new`` (the value, or its number of elements when ``new_sample`` is given)
    may be smaller than the delta blob already encoded (``delta_size`` bytes): dense is estimated from a
    sample of ``new``, scaled to the whole group (see module docstring), unless the caller has that
    ``estimate``. (The delta used to be estimated on the same sample too: for the many groups of a few MiB
    that sample was a third to all of the group, compressed twice before the group itself.)"""
    if estimate is None:
        s = _sample(new) if new_sample is None else new_sample
        estimate = dense_estimate(s, new if isinstance(new, int) else new.size, level)
    return estimate <= delta_size * DENSE_MARGIN


def _stager(store):
    """Where candidates are staged: beside ``store``'s objects (publishing is then a rename), else the
    system's temp directory."""
    if store is None:
        return lambda chunks: stage_chunks(chunks)
    return store.stage


def choose(new: np.ndarray, previous: np.ndarray | None, level: int = codec.DEFAULT_LEVEL, store=None,
           with_dense: bool = True, dense_est: float | None = None) -> Choice | None:
    """The smallest exact encoding of ``new`` given ``previous`` (None: no previous value), staged beside
    ``store`` (an LfsStore; None: a system temp file). ``with_dense=False``: dense is not a candidate (the
    caller has it already); None when nothing else applies. ``dense_est``: the caller's estimate of the dense
    blob's size (:func:`dense_estimate`), else made here when needed."""
    picker = _Picker(level, store, with_dense)
    consider = picker.consider
    if same_layout(new, previous):
        new_s, prev_s = _sample(new), _sample(previous)
        # sparse can win only when at most half of the elements changed; when nearly all of the sample did (a
        # fine-tune), the exact count, a pass over both values, is not worth making
        mostly = changed_count(new_s, prev_s) >= MOSTLY_CHANGED * new_s.size > 0
        k = new.size if mostly else changed_count(new, previous)
        if 2 * k <= new.size:
            consider("sparse", get("sparse").encode(new, previous))
        if k:
            consider("delta", get("delta").encode(new, previous))
            if dense_might_win(new, picker.tried["delta"], level, new_sample=new_s, estimate=dense_est):
                consider("dense", get("dense").encode(new, None))
    else:
        # lazy: the new rows are gathered frame by frame while compressed (no copy of them beside new and
        # previous)
        rows = get("rows").encode(new, previous, lazy=True) if previous is not None else None
        consider("rows", rows)
        # rows stores the genuinely new rows plus a row map that compresses to almost nothing; dense stores
        # every row: when at most half the rows are new, compressing the whole value cannot pay off
        if rows is None or 2 * rows.parts["extra"].shape[0] > new.shape[0]:
            consider("dense", get("dense").encode(new, None))
    assert picker.best is not None or not with_dense  # dense, or delta on a changed same-layout group, encodes
    return picker.best


class _Picker:
    """Stages each candidate encoding as it comes and keeps the smallest (the others are discarded)."""

    def __init__(self, level: int, store, with_dense: bool = True):
        self.level, self.with_dense, self.stage = level, with_dense, _stager(store)
        self.best: Choice | None = None
        self.tried: dict[str, int] = {}

    def consider(self, name: str, encoded: Encoded | None) -> None:
        if encoded is None or (name == "dense" and not self.with_dense):
            return
        self.consider_staged(name, encoded.params, self.stage(codec.iter_encode_parts(encoded.parts, self.level)))

    def consider_staged(self, name: str, params: dict, staged: Staged) -> None:
        """A candidate already encoded and staged (kept or discarded like the others)."""
        self.tried[name] = staged.size
        if self.best is None or staged.size < self.best.size:
            if self.best is not None:
                self.best.staged.discard()
            self.best = Choice(name, dict(params), staged, self.tried)  # parts dropped: memory
        else:
            staged.discard()


def _change_of_grown(new: np.ndarray, previous: np.ndarray, level: int, store, with_dense: bool) -> Choice | None:
    """:func:`choose` of ``new`` against the value a positional ``rows`` step builds from ``previous`` when the
    group grew (``previous``'s rows, then ``new``'s rows beyond them), without building that value: the two
    differ only in the first ``m`` rows, so the change is counted and encoded from ``new[:m]`` and
    ``previous`` (the same blobs as from the built value, bit for bit); the rest of the delta's code words are
    zeros and sparse has no index there. Memory: ``new``, ``previous`` and codec frames (a group grown and
    fine-tuned in one commit holds no third copy). None when nothing changed."""
    m = previous.shape[0]
    head = new[:m]
    k = changed_count(head, previous)
    if not k:
        return None
    picker = _Picker(level, store, with_dense)
    if 2 * k <= new.size and index_dtype(head.size) == index_dtype(new.size):
        picker.consider("sparse", get("sparse").encode(head, previous))
    new_words, prev_words = raw_words(new), raw_words(previous)
    split = prev_words.size  # words of the rows the two values do not share

    def codes(a: int, b: int, op: str = OPS[0]) -> np.ndarray:
        if b <= split:
            return combine(new_words[a:b], prev_words[a:b], op)
        out = np.zeros(b - a, new_words.dtype)
        if a < split:
            out[:split - a] = combine(new_words[a:split], prev_words[a:split], op)
        return out

    picker.consider("delta", Encoded(parts={"codes": codec.LazyArray(new_words.dtype, (new_words.size,), codes,
                                                                     planes=True)}, params={"op": OPS[0]}))
    if with_dense and dense_might_win(new, picker.tried["delta"], level):
        picker.consider("dense", get("dense").encode(new, None))
    return picker.best


# ---------------------------------------------------------------- the clean filter's policy
def _auto_on_keyframe(new: np.ndarray, new_hash: str, previous, previous_value, store, options,
                      self_contained, on_previous=None) -> list:
    """auto's chain for a changed group whose previous chain is a split keyframe: the value rebased on that
    keyframe, counting on the way how many elements changed -- without rebuilding the previous value, which
    only a change of few elements needs (a step appended to the chain may then fit the budget, and be smaller).
    ``on_previous``: :func:`theta.updates.keyframe.rebase`'s ``beside``."""
    budget = keyframe.Budget(dense_estimate(_sample(new), new.size, options.level), options.keyframe_ratio)
    try:
        r = keyframe.rebase(new, previous, store, options.level, count=True, beside=on_previous)
    except (BlobMissingError, IntegrityError):  # the keyframe is not here, or unusable: stored self-contained
        r = None
    if r is not None and not budget.append_may_fit(previous, lambda: budget.self_contained * r.changed / new.size):
        if budget.fits(r.fetch_bytes):
            return r.keep(new_hash, store)
        r.discard()
        return self_contained()
    base = previous_value()  # few elements changed: a step on the previous value is a candidate too
    if base is None:
        if r is not None and budget.fits(r.fetch_bytes):
            return r.keep(new_hash, store)
        if r is not None:
            r.discard()
        return self_contained()
    choice = choose(new, base, options.level, store, dense_est=budget.self_contained)
    appended = keyframe.fetch_bytes(previous.steps) + choice.size
    if choice.update_type != "dense" and budget.fits(appended) and (r is None or choice.size < r.staged.size):
        if r is not None:
            r.discard()
        return [*previous.steps, steps.store_staged(choice.update_type, choice.staged, choice.params, new_hash,
                                                    store)]
    choice.staged.discard()
    if r is not None and budget.fits(r.fetch_bytes):
        return r.keep(new_hash, store)
    if r is not None:
        r.discard()
    return self_contained()


def _auto_chain(new: np.ndarray, new_hash: str, base: np.ndarray, base_meta, store, options, self_contained) -> list:
    """auto's chain for a changed group whose previous value ``base`` (its metadata ``base_meta``) is local: the
    smallest step appended to the previous chain when the chain then still fits the keyframe budget
    (theta.updates.keyframe), else a rebased or self-contained chain. Each candidate is staged, and kept only
    once the chain it makes is known to fit."""
    new_s = _sample(new)
    budget = keyframe.Budget(dense_estimate(new_s, new.size, options.level), options.keyframe_ratio)

    def step_estimate() -> float | None:  # a delta of the samples, scaled to the group
        if not same_layout(new, base):
            return None
        enc = get("delta").encode(new_s, _sample(base))
        return len(codec.encode_parts(enc.parts, options.level)) * (new.size / max(new_s.size, 1))

    if not budget.append_may_fit(base_meta, step_estimate):
        return keyframe.without_append(new, new_hash, base_meta, store, budget, options.level)
    choice = choose(new, base, options.level, store, dense_est=budget.self_contained)
    staged = [(choice.update_type, choice.staged, choice.params, new_hash)]
    if (choice.update_type == "dense" and base.shape != new.shape
            and len(base_meta.steps) + 2 <= options.max_chain):
        two = resize_then_change(new, base, options.level, store, dense_size=choice.size)
        if two is not None and two[0].size + two[1].size < choice.size * TWO_STEP_MARGIN:
            choice.staged.discard()
            resized, changed, resized_hash = two
            staged = [("rows", resized.staged, resized.params, resized_hash),
                      (changed.update_type, changed.staged, changed.params, new_hash)]
        elif two is not None:
            two[0].staged.discard()
            two[1].staged.discard()
    if staged[0][0] == "dense":  # self-contained anyway: stored as auto's keyframe (split when it is split)
        if keyframe.split_op(new.dtype, new.nbytes) is None:
            return [steps.store_staged("dense", choice.staged, {}, new_hash, store)]
        choice.staged.discard()
        return self_contained()
    fetch = keyframe.fetch_bytes(base_meta.steps) + sum(s[1].size for s in staged)
    if not budget.fits(fetch):
        for s in staged:
            s[1].discard()
        return keyframe.without_append(new, new_hash, base_meta, store, budget, options.level)
    return [*base_meta.steps, *(steps.store_staged(t, st, params, h, store) for t, st, params, h in staged)]



TWO_STEP_MARGIN = 0.9  # resize + change must save 10 % over dense to be worth a two-step chain link


def resize_then_change(new: np.ndarray, previous: np.ndarray, level: int = codec.DEFAULT_LEVEL, store=None,
                       dense_size: int | None = None):
    """A group resized along its first dimension AND changed in the same commit (e.g. vocabulary trimmed
    during a fine-tune: no row is bit-identical, so ``rows`` alone finds nothing). Two exact steps:
    ``rows`` keeps the previous rows by position (the first ``min(n, m)``, plus the rows appended in
    ``new``), then sparse/delta from that to ``new``. Returns (rows Choice, change Choice, hash of the
    resized value), or None when the change is best stored dense anyway (``dense_size``: the size of the
    dense blob the caller has, so dense is not encoded again).

    Memory: ``new``, ``previous`` and codec frames: a trimmed value is a view of ``previous``; an extended
    one is never built (:func:`_change_of_grown` encodes the change from ``new`` and ``previous``)."""
    n, m = new.shape[0], previous.shape[0]
    k = min(n, m)
    if k == 0:
        return None
    new = np.ascontiguousarray(new)
    sources = np.concatenate([np.arange(k, dtype=np.int64), np.full(n - k, -1, dtype=np.int64)])
    extra = new[k:]  # a view: rows are contiguous
    rows_enc = Encoded(parts={"source_gaps": encode_sources(sources), "extra": extra}, params={"rows": int(n)})
    previous = np.ascontiguousarray(previous)
    if n <= m:
        resized = previous[:n]  # what rows.apply would build, as a view
        if not changed_count(new, resized):
            return None  # nothing changed beyond the resize: rows alone (chosen before) says it
        change = choose(new, resized, level, store, with_dense=dense_size is None)
        resized_hash = content_hash(resized)
    else:
        change = _change_of_grown(new, previous, level, store, with_dense=dense_size is None)
        if change is None:
            return None
        h = valuehash.new(le_bytes(previous))  # the grown value's bytes: previous's, then the appended rows
        h.update(le_bytes(extra))
        resized_hash = h.hexdigest()
    if change is None or change.update_type == "dense" or (dense_size is not None and change.size >= dense_size):
        if change is not None:
            change.staged.discard()
        return None
    stage = _stager(store)
    rows_choice = Choice("rows", dict(rows_enc.params), stage(codec.iter_encode_parts(rows_enc.parts, level)))
    return rows_choice, change, resized_hash


def rows_may_apply(previous_meta, new: np.ndarray) -> bool:
    """Can ``rows`` derive ``new`` from this previous version of another shape? (Checked before rebuilding
    the previous value: same dtype and number of dims, same trailing dims, at least one dim.)"""
    prev_shape = tuple(previous_meta.shape)
    return (new.ndim >= 1 and len(prev_shape) == new.ndim and prev_shape[1:] == tuple(new.shape[1:])
            and dtypes.get(previous_meta.dtype).to_numpy() == new.dtype)


def encode_change(name: str, new: np.ndarray, new_hash: str, previous, previous_value, store, options, *,
                  reshaped_previous=None, update_data=None, on_previous=None) -> list:
    """The step chain of a changed group (what ``theta.model.clean.encode_changed_group`` returns).

    ``options.update_type``: "auto" (default) picks the smallest exact encoding; "dense" stores the
    value; "sparse"/"delta"/"rows" encode the difference; "low-rank"/"ia3" are inferred and kept only
    when they reproduce ``new`` within ``options.rtol``/``options.atol`` with few exact fixes (else dense).
    Every step rebuilds ``new`` bit for bit, so its hash is ``new_hash``. A group present in the
    side-loaded ``update_data`` is stored as that update after checking it reproduces ``new`` (the other
    changed groups then go through "auto"). A chain that reached
    ``options.max_chain`` steps gets a self-contained (dense) step instead. ``reshaped_previous``: the
    previous version of a group whose shape changed (for ``rows``). ``on_previous(start, stop, words)``: given
    the previous value's words range by range when it is rebuilt frame by frame beside a rebase on its split
    keyframe instead of whole (:func:`theta.updates.keyframe.rebase`).
    """
    def store_dense() -> list:
        return [steps.store_dense(new, store, options.level, new_hash)]

    def self_contained() -> list:  # auto's keyframe: split for big float groups (theta.updates.keyframe)
        return keyframe.split_keyframe(new, new_hash, store, options.level) or store_dense()

    if update_data is not None and name in update_data:
        prev_val = previous_value() if previous is not None else None
        if prev_val is None:
            why = "its previous version's blobs are not in the local store (git lfs fetch)" if previous is not None \
                else "it has no previous version of the same dtype and shape"
            raise UpdateDataError(f"update data {update_data.path}: group {name!r}: cannot apply the update, {why}")
        verified = update_data.verify(name, new, prev_val, options.rtol, options.atol)
        if verified.update_type == "dense" or steps.chain_full(previous, options.max_chain):
            return store_dense()  # checked, but the chain is long enough: store the value itself
        enc = verified.encoded
        step = steps.store_step(verified.update_type, enc.parts, enc.params, new_hash, store, options.level)
        return steps.chain(previous, step, True)

    # with side-loaded data, --update-type names the file's type: the other groups are plain changes
    wanted = "auto" if update_data is not None else (options.update_type or "auto")
    if (wanted == "auto" and previous is not None and is_split_chain(previous)
            and not steps.chain_full(previous, options.max_chain)):
        return _auto_on_keyframe(new, new_hash, previous, previous_value, store, options, self_contained,
                                 on_previous)
    base, base_meta = None, None
    if previous is not None and not steps.chain_full(previous, options.max_chain):
        base, base_meta = previous_value(), previous
    elif (reshaped_previous is not None and not steps.chain_full(reshaped_previous, options.max_chain)
          and wanted in ("auto", "rows") and rows_may_apply(reshaped_previous, new)):
        try:
            base = reconstruct(reshaped_previous, store)
        except (BlobMissingError, IntegrityError, MetadataError):
            base = None  # not fetched locally, or broken: store the value itself
        if base is not None:
            # the chain continues across the change of shape: its earlier steps record their own shape
            # (same dtype: rows_may_apply checked it)
            base_meta = replace(reshaped_previous,
                                steps=relayout_steps(reshaped_previous, reshaped_previous.dtype, new.shape))
    if base is None:
        if wanted not in ("auto", "dense"):
            get(wanted)  # an unknown name still fails clearly
        return self_contained() if wanted == "auto" else store_dense()

    if wanted == "auto":
        return _auto_chain(new, new_hash, base, base_meta, store, options, self_contained)

    ut = get(wanted)
    enc = ut.encode(new, base if ut.incremental else None, rtol=options.rtol, atol=options.atol)
    if enc is None:
        return store_dense()
    step = steps.store_step(ut.name, enc.parts, enc.params, new_hash, store, options.level)
    return steps.chain(base_meta, step, ut.incremental)
