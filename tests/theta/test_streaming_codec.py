"""Streaming paths of the codec and the updates: lazy arrays, byte planes for integer words, frame
by frame decoding, delta/sparse applied from the blob (in place), staged candidate blobs, bounded reconstruct
of a chain of 8 -- every one bit for bit, and old-layout delta blobs still decode."""

import ml_dtypes
import numpy as np
import pytest

from theta.base.errors import StoreError
from theta.storage import codec
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore, stage_chunks
from theta.updates import content_hash, get, steps
from theta.updates.rebuild import reconstruct
from theta.updates.auto import choose, resize_then_change
from theta.updates.delta import combine, changed_count, raw_words, to_planes
from support.traced import traced_peak

FLOATS = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float64),
          np.dtype(np.complex128)]
WORDS = [np.dtype(t) for t in ("<u2", "<u4", "<u8", "<i2", "<i4", "<i8")]


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def weights(rng, shape, dtype) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(dtype)


def tuned(rng, prev: np.ndarray) -> np.ndarray:
    """prev x (1 + 1e-3 N(0, 1)) in prev's dtype, with special values mixed in (exactness on every word)."""
    wide = prev.astype(np.complex128 if prev.dtype.kind == "c" else np.float64)
    out = (wide * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(prev.dtype)
    flat = out.reshape(-1)
    flat[:4] = np.array([-0.0, np.nan, np.inf, 0.0]).astype(prev.dtype)
    return out


@pytest.fixture(autouse=True)
def small_frames(monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)  # many frames, an uneven last one


# ------------------------------------------------------------------------------------------------ codec
@pytest.mark.parametrize("dtype", FLOATS + WORDS, ids=str)
def test_lazy_array_encodes_the_same_blob_as_the_array(dtype):
    a = np.random.default_rng(0).integers(0, 256, 10007 * dtype.itemsize, dtype=np.uint8).view(dtype)
    flat = a.reshape(-1)
    calls = []

    def read(s, e):
        calls.append((s, e))
        return flat[s:e]

    lazy = codec.LazyArray(a.dtype, a.shape, read)
    assert codec.encode_array(lazy) == codec.encode_array(a)
    assert len(calls) > 1 and calls[0][0] == 0 and calls[-1][1] == a.size  # pulled frame by frame


@pytest.mark.parametrize("dtype", WORDS, ids=str)
def test_integer_words_in_byte_planes_round_trip(dtype):
    rng = np.random.default_rng(1)
    a = rng.integers(-300, 300, 9001).astype(dtype)  # high bytes mostly 0 or 0xff: what planes are for
    blob = codec.encode_array(codec.planed(a))
    header, _ = codec._trailer(memoryview(blob), codec.ARRAY_MAGIC, "array")
    assert header["enc"] == "planes" and all(len(sizes) == dtype.itemsize for _, sizes in header["frames"])
    out = codec.decode_array(blob)
    assert out.dtype == a.dtype and bits(out) == bits(a)


def test_delta_codes_compress_better_in_planes(monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 1 << 20)
    rng = np.random.default_rng(10)
    prev = weights(rng, 1 << 18, np.float32)
    codes = combine(raw_words(tuned(rng, prev)), raw_words(prev), "zigzag")
    assert len(codec.encode_array(codec.planed(codes))) < 0.9 * len(codec.encode_array(codes))


@pytest.mark.parametrize("dtype", FLOATS + WORDS + [np.dtype(np.int8), np.dtype(bool)], ids=str)
def test_iter_decode_array_yields_every_frame_in_order(dtype):
    a = np.random.default_rng(2).integers(0, 2, 7777 * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(-1, 7)
    blob = codec.encode_array(a)
    got, start = [], 0
    for first, frame in codec.iter_decode_array(blob):
        assert first == start and frame.dtype == a.dtype
        got.append(frame)
        start += frame.size
    assert start == a.size and bits(np.concatenate(got)) == bits(a)
    assert codec.array_info(blob) == (a.dtype, a.shape)


def test_lazy_array_of_the_wrong_length_is_refused():
    lazy = codec.LazyArray(np.dtype("<u4"), (100,), lambda s, e: np.zeros(e - s + 1, np.uint32))
    with pytest.raises(codec.CodecError, match="lazy array gave"):
        codec.encode_array(lazy)


def test_corrupt_frame_in_a_streamed_decode_fails_clearly():
    a = np.arange(5000, dtype=np.uint32)
    blob = bytearray(codec.encode_array(codec.planed(a)))
    blob[40] ^= 0xFF
    with pytest.raises(codec.CodecError):
        for _ in codec.iter_decode_array(bytes(blob)):
            pass


# ------------------------------------------------------------------------------------------------ delta
def old_layout_delta_blob(new: np.ndarray, prev: np.ndarray, op: str = "zigzag") -> bytes:
    """A delta blob in the older layout theta still reads: part "planes" (word bytes, n) uint8."""
    words = combine(raw_words(new), raw_words(prev), op)
    return codec.encode_parts({"planes": to_planes(words)})


@pytest.mark.parametrize("dtype", FLOATS + [np.dtype(np.int8)], ids=str)
@pytest.mark.parametrize("op", ["zigzag", "xor", "sub"])
def test_delta_new_layout_bit_for_bit_every_way(dtype, op):
    rng = np.random.default_rng(3)
    prev = rng.integers(-100, 100, (97, 33)).astype(dtype) if dtype.kind == "i" else weights(rng, (97, 33), dtype)
    new = (prev + 1).astype(dtype) if dtype.kind == "i" else tuned(rng, prev)
    enc = get("delta").encode(new, prev, op=op)
    assert set(enc.parts) == {"codes"} and isinstance(enc.parts["codes"], codec.LazyArray)
    blob = codec.encode_parts(enc.parts)
    full = get("delta").apply(codec.decode_parts(blob), enc.params, prev)
    copy = get("delta").apply_blob(codec.part_blobs(blob), enc.params, prev, in_place=False)
    mine = prev.copy()
    inplace = get("delta").apply_blob(codec.part_blobs(blob), enc.params, mine, in_place=True)
    for out in (full, copy, inplace):
        assert out.dtype == new.dtype and out.shape == new.shape and bits(out) == bits(new)
    assert inplace is mine  # updated in place: no second group-sized array
    assert bits(prev) != bits(new) and bits(copy) != bits(prev)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_old_layout_delta_blobs_still_decode(dtype):
    rng = np.random.default_rng(4)
    prev = weights(rng, (50, 41), dtype)
    new = tuned(rng, prev)
    blob = old_layout_delta_blob(new, prev)
    assert bits(get("delta").apply(codec.decode_parts(blob), {"op": "zigzag"}, prev)) == bits(new)
    mine = prev.copy()
    out = get("delta").apply_blob(codec.part_blobs(blob), {"op": "zigzag"}, mine, in_place=True)
    assert bits(out) == bits(new)


def test_changed_count_is_exact_on_raw_bits(monkeypatch):
    import theta.updates.delta as delta

    monkeypatch.setattr(delta, "CHUNK", 100)  # several chunks
    a = np.zeros(1234, np.float32)
    b = a.copy()
    b[[0, 99, 100, 1233]] = [-0.0, 1, np.nan, 2]  # -0.0 differs from +0.0 in its bits
    assert changed_count(b, a) == 4
    c = np.zeros(300, np.complex128)
    d = c.copy()
    d[7] = 1j
    assert changed_count(d, c) == 1


def test_sparse_apply_blob_in_place_is_exact():
    rng = np.random.default_rng(5)
    prev = weights(rng, (64, 64), np.float32)
    new = prev.copy()
    new.reshape(-1)[rng.choice(new.size, 40, replace=False)] = 7
    enc = get("sparse").encode(new, prev)
    blob = codec.encode_parts(enc.parts)
    mine = prev.copy()
    out = get("sparse").apply_blob(codec.part_blobs(blob), enc.params, mine, in_place=True)
    assert out is mine and bits(out) == bits(new)
    out = get("sparse").apply_blob(codec.part_blobs(blob), enc.params, prev, in_place=False)
    assert out is not prev and bits(out) == bits(new)


# ------------------------------------------------------------------------------------------------ store
def test_staged_blob_publish_discard_and_drop(tmp_path):
    store = LfsStore(tmp_path / "lfs" / "objects")
    tmp_dir = tmp_path / "lfs" / "tmp"
    kept = store.stage([b"abc", b"def"])
    assert kept.size == 6 and kept.read() == b"abcdef"
    ref = kept.publish()
    assert store.get(ref) == b"abcdef" and ref.oid == __import__("hashlib").sha256(b"abcdef").hexdigest()
    gone = store.stage([b"xyz"])
    gone.discard()
    dropped = store.stage([b"123"])
    del dropped  # dropped without publish: its temp file goes too
    assert list(tmp_dir.iterdir()) == []
    assert not store.has(gone.ref)
    again = store.stage([b"abc", b"def"])  # an object already stored: publishing is a no-op, temp removed
    assert again.publish() == ref and list(tmp_dir.iterdir()) == []
    elsewhere = stage_chunks([b"q"], tmp_path / "other")
    with pytest.raises(StoreError):
        elsewhere.publish()
    assert store.get(elsewhere.publish(store)) == b"q"


def test_auto_choice_stages_only_the_winner(tmp_path):
    store = LfsStore(tmp_path / "lfs" / "objects")
    rng = np.random.default_rng(6)
    prev = weights(rng, (256, 256), np.float32)
    new = tuned(rng, prev)
    c = choose(new, prev, store=store)
    # the losers are gone (staged files have no name: O_TMPFILE), the winner is staged, not yet stored
    assert c.update_type == "delta" and list((tmp_path / "lfs" / "tmp").iterdir()) == []
    assert not store.has(c.staged.ref) and c.staged.read()[:4] == codec.PARTS_MAGIC
    step = steps.store_staged(c.update_type, c.staged, c.params, content_hash(new), store)
    assert list((tmp_path / "lfs" / "tmp").iterdir()) == []
    out = get("delta").apply(codec.decode_parts(store.get(step.blob)), step.params, prev)
    assert bits(out) == bits(new)


def test_trim_and_fine_tune_builds_the_resized_value_as_a_view(tmp_path):
    rng = np.random.default_rng(7)
    prev = weights(rng, (300, 16), np.float32)
    new = tuned(rng, prev[:280])
    two = resize_then_change(new, prev)
    assert two is not None
    rows_choice, change, resized_hash = two
    assert resized_hash == content_hash(prev[:280])
    resized = get("rows").apply(codec.decode_parts(rows_choice.blob), rows_choice.params, prev)
    assert bits(resized) == bits(prev[:280])
    out = get(change.update_type).apply(codec.decode_parts(change.blob), change.params, resized)
    assert bits(out) == bits(new)


# ------------------------------------------------------------------------------------------------ reconstruct
def chain_of(store, values: list[np.ndarray]) -> GroupMeta:
    """A group whose chain is dense(values[0]) then one delta per later value, stored in ``store``."""
    chain = [steps.store_dense(values[0], store)]
    for prev, new in zip(values, values[1:]):
        enc = get("delta").encode(new, prev)
        chain.append(steps.store_step("delta", enc.parts, enc.params, content_hash(new), store))
    last = values[-1]
    return GroupMeta(name="w", dtype="float32", shape=tuple(last.shape), hash=content_hash(last), steps=chain)


def test_reconstruct_chain_of_8_is_exact_and_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)  # frames small next to the group, as in real use
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(8)
    values = [weights(rng, (1024, 1024), np.float32)]  # 4 MiB group
    for _ in range(7):
        values.append(tuned(rng, values[-1]))
    group = chain_of(store, values)
    group_bytes = values[-1].nbytes
    want = bits(values[-1])
    del values
    out, peak = traced_peak(reconstruct, group, store)
    assert bits(out) == want
    # one value updated in place + a few frames; the layout before kept 3 values (previous, codes, new)
    assert peak <= 1.5 * group_bytes, peak / group_bytes


def test_reconstruct_never_updates_a_cached_value_in_place(tmp_path):
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(9)
    v = [weights(rng, (40, 40), np.float32)]
    v.append(tuned(rng, v[0]))
    v.append(tuned(rng, v[1]))
    group = chain_of(store, v)
    first = chain_of(store, v[:1])
    cache: dict = {}
    base = reconstruct(first, store, cache)
    snapshot = bits(base)
    out = reconstruct(group, store, cache)
    assert bits(out) == bits(v[2]) and bits(base) == snapshot and bits(cache[first.hash]) == snapshot


def test_clean_refuses_to_build_on_a_previous_value_that_does_not_match_its_hash(tmp_path):
    """The rebuilt previous value's hash is checked on another thread while the change is encoded against it:
    a mismatch still fails the clean, naming the file and the group."""
    import safetensors.numpy

    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.base.errors import UpdateTypeError

    chains = CleanOptions(keyframe_ratio=float("inf"))  # keyframes off: the change is built on the previous value

    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(11)
    w = weights(rng, (64, 64), np.float32)
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": w}, str(path))
    first = clean_checkpoint(path, store, None)
    safetensors.numpy.save_file({"w": tuned(rng, w)}, str(path))
    good = clean_checkpoint(path, store, first, chains)
    assert good.groups["w"].steps[-1].type == "delta"
    first.groups["w"].hash = "0" * 64  # as if its blob decoded to other values
    with pytest.raises(UpdateTypeError, match=r"m\.safetensors.*'w'.*content hash"):
        clean_checkpoint(path, store, first, chains)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.3, 1.0])
def test_lazy_sparse_blob_equals_the_eager_one(monkeypatch, fraction):
    import theta.updates.delta as delta
    import theta.updates.sparse as sparse

    monkeypatch.setattr(delta, "CHUNK", 1000)
    monkeypatch.setattr(sparse, "CHUNK", 1000)  # changes spread over many chunks and frames
    rng = np.random.default_rng(12)
    prev = weights(rng, 25_013, np.float32)
    new = prev.copy()
    idx = rng.choice(new.size, int(fraction * new.size), replace=False)
    new[idx] = weights(rng, idx.size, np.float32)
    lazy = get("sparse").encode(new, prev)
    eager = get("sparse").encode(new, prev, lazy=False)
    assert isinstance(lazy.parts["gaps"], codec.LazyArray) and lazy.params == eager.params
    blob = codec.encode_parts(lazy.parts)
    assert blob == codec.encode_parts(eager.parts)
    assert bits(get("sparse").apply(codec.decode_parts(blob), lazy.params, prev)) == bits(new)
