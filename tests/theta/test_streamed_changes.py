"""The streamed paths of the memory bound, checked bit for bit against the whole-value computations they
replace (real blobs in a real store): a group grown and fine-tuned in one commit (its change encoded without
building the grown value), rows' new rows gathered lazily, a chain that grows rebuilt in one buffer, IA3 applied
and side-loaded block of rows by block of rows, low-rank applied in place, a chain of 8 mixed steps. Traced
peaks (tracemalloc) are extra checks; the bound itself is measured by scripts/bench/git.py
(tests/e2e/test_memory_bounds.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import save_file
from support.traced import traced_peak

from theta.base.errors import UpdateDataError
from theta.peers.gittheta import update_files as sideload
from theta.storage import codec
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore
from theta.updates import auto, content_hash, get, ia3, steps
from theta.updates.auto import _change_of_grown, choose, resize_then_change
from theta.updates.rebuild import reconstruct


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def weights(rng, shape, dtype=np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(dtype)


def tuned(rng, x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32) * (1 + 1e-3 * rng.standard_normal(x.shape))).astype(x.dtype)


def grown_value(prev: np.ndarray, new: np.ndarray) -> np.ndarray:
    """What a positional rows step builds: previous's rows, then new's rows beyond them."""
    return np.concatenate([prev, new[prev.shape[0]:]])


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "objects")


# ------------------------------------------------------------------ grown and fine-tuned in one commit
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("edit", ["every row tuned", "a few elements changed"])
def test_change_of_grown_is_the_change_of_the_built_value(store, dtype, edit):
    """Same winner, same blob bytes as choose() against the grown value built whole."""
    rng = np.random.default_rng(1)
    prev = weights(rng, (300, 24), dtype)
    head = tuned(rng, prev) if edit == "every row tuned" else prev.copy()
    if edit != "every row tuned":
        head.reshape(-1)[[5, 77, 4000]] += dtype(1)
    new = np.concatenate([head, weights(rng, (20, 24), dtype)])
    want = choose(new, grown_value(prev, new), store=store)
    got = _change_of_grown(new, prev, codec.DEFAULT_LEVEL, store, True)
    assert got.update_type == want.update_type and got.tried == want.tried  # the same candidates, same sizes
    assert got.params == want.params and got.blob == want.blob
    assert set(got.tried) == ({"delta"} if edit == "every row tuned" else {"sparse", "delta"})


def test_change_of_grown_dense_candidate_matches(store, monkeypatch):
    """Random new values (dense can win): the sampled comparison sees the grown value's bytes too."""
    monkeypatch.setattr(auto, "DENSE_MARGIN", 100.0)  # dense always encoded: its blob must be the same
    rng = np.random.default_rng(2)
    prev = weights(rng, (64, 16))
    new = weights(rng, (80, 16))
    want = choose(new, grown_value(prev, new), store=store)
    got = _change_of_grown(new, prev, codec.DEFAULT_LEVEL, store, True)
    assert got.update_type == want.update_type and got.blob == want.blob
    assert got.tried == want.tried


def test_grown_and_tuned_two_steps_rebuild_bit_for_bit_without_a_third_copy(store, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    rng = np.random.default_rng(3)
    prev = weights(rng, (8192, 512))  # 16 MiB (the sample auto compares on is ~4 MiB whatever the size)
    new = np.concatenate([tuned(rng, prev), weights(rng, (64, 512))])
    two, peak = traced_peak(resize_then_change, new, prev, codec.DEFAULT_LEVEL, store)
    rows_choice, change, resized_hash = two
    built = grown_value(prev, new)
    assert resized_hash == content_hash(built)
    resized = get("rows").apply(codec.decode_parts(rows_choice.blob), rows_choice.params, prev)
    assert bits(resized) == bits(built)
    out = get(change.update_type).apply(codec.decode_parts(change.blob), change.params, resized)
    assert bits(out) == bits(new)
    assert peak <= 0.5 * new.nbytes, peak / new.nbytes  # the grown value (1 x) is never built


def test_rows_new_rows_gathered_lazily_give_the_same_blob():
    rng = np.random.default_rng(4)
    prev = weights(rng, (500, 12))
    new = np.concatenate([prev[:100], weights(rng, (150, 12)), prev[300:], weights(rng, (7, 12))])
    eager, lazy = get("rows").encode(new, prev), get("rows").encode(new, prev, lazy=True)
    assert isinstance(lazy.parts["extra"], codec.LazyArray) and lazy.parts["extra"].shape == eager.parts["extra"].shape
    assert codec.encode_parts(lazy.parts) == codec.encode_parts(eager.parts)


# ------------------------------------------------------------------ chains
def chain_group(store, values: list[np.ndarray], links: list[tuple[str, dict]]) -> GroupMeta:
    """dense(values[0]) then one step per (type, encoded parts override) link; each step's layout recorded."""
    chain = [steps.store_dense(values[0], store)]
    for (kind, parts_params), prev, new in zip(links, values, values[1:]):
        enc = parts_params or get(kind).encode(new, prev)
        assert enc is not None, kind
        chain.append(steps.store_step(kind, enc.parts, enc.params, content_hash(new), store))
    last = values[-1]
    chain = [dataclasses.replace(s, params={**s.params, "shape": list(v.shape)}) if v.shape != last.shape else s
             for s, v in zip(chain, values)]
    return GroupMeta(name="embed", dtype=str(last.dtype), shape=tuple(last.shape), hash=content_hash(last),
                     steps=chain)


def ia3_step(prev: np.ndarray, vec: np.ndarray):
    value = ia3.scale(prev, vec)
    from theta.updates.sparse import residual

    fixes, count = residual(value, value)
    return value, ia3.Encoded(parts={"ia3": vec, **fixes}, params={"fixes": count})


def low_rank_step(prev: np.ndarray, R: np.ndarray, C: np.ndarray):
    from theta.updates.low_rank import exact_encoding_by_rows

    value = get("low-rank").apply({"R": R, "C": C}, {}, prev)
    enc, count = exact_encoding_by_rows(value, prev, R, C)
    assert count == 0
    return value, enc


def mixed_chain_of_8(rng, rows=1024, cols=256, grow=64):
    """dense, rows (grown, positional), delta, ia3, low-rank, delta, sparse, delta: every value, the links."""
    v0 = weights(rng, (rows, cols))
    grown = np.concatenate([v0, weights(rng, (grow, cols))])
    v1 = grown
    v2 = tuned(rng, v1)
    v3, ia3_enc = ia3_step(v2, (1 + 0.01 * rng.standard_normal((1, cols))).astype(np.float32))
    R, C = (rng.standard_normal((rows + grow, 4)) * 0.01).astype(np.float32), \
        (rng.standard_normal((4, cols)) * 0.01).astype(np.float32)
    v4, lr_enc = low_rank_step(v3, R, C)
    v5 = tuned(rng, v4)
    v6 = v5.copy()
    v6.reshape(-1)[::997] += np.float32(0.5)
    v7 = tuned(rng, v6)
    from theta.updates.rows import encode_sources

    n = rows + grow
    sources = np.concatenate([np.arange(rows, dtype=np.int64), np.full(grow, -1, np.int64)])
    rows_enc = ia3.Encoded(parts={"source_gaps": encode_sources(sources), "extra": grown[rows:]},
                           params={"rows": n})
    values = [v0, v1, v2, v3, v4, v5, v6, v7]
    links = [("rows", rows_enc), ("delta", None), ("ia3", ia3_enc), ("low-rank", lr_enc), ("delta", None),
             ("sparse", None), ("delta", None)]
    return values, links


def test_mixed_chain_of_8_rebuilds_every_value_bit_for_bit(store):
    rng = np.random.default_rng(5)
    values, links = mixed_chain_of_8(rng, rows=200, cols=32, grow=9)
    for i in range(1, len(values) + 1):
        g = chain_group(store, values[:i], links[:i - 1])
        assert len(g.steps) == i
        out = reconstruct(g, store)
        assert out.shape == values[i - 1].shape and bits(out) == bits(values[i - 1]), i


def test_mixed_chain_of_8_that_grows_is_rebuilt_in_one_buffer(store, monkeypatch):
    """dense + a grown rows step + ia3 + low-rank + ...: one value (the grown size) and a few frames, not the
    value before the growth and the grown one."""
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)  # frames and blocks small next to the group, as in use
    monkeypatch.setattr(ia3, "BLOCK_ELEMENTS", 1 << 16)
    rng = np.random.default_rng(6)
    values, links = mixed_chain_of_8(rng, rows=4096, cols=512, grow=64)  # 8 MiB
    g = chain_group(store, values, links)
    want, size = bits(values[-1]), values[-1].nbytes
    del values, links
    out, peak = traced_peak(reconstruct, g, store)
    assert bits(out) == want
    assert peak <= 1.4 * size, peak / size  # was 3 x before the buffer (value before the growth, grown, gather)


@pytest.mark.parametrize("edit", ["rows inserted in the middle", "rows moved back (not in place)"])
def test_rows_growth_in_the_buffer_or_not_is_exact(store, edit):
    rng = np.random.default_rng(7)
    prev = weights(rng, (400, 8))
    extra = weights(rng, (30, 8))
    new = (np.concatenate([prev[:100], extra, prev[100:]]) if edit.startswith("rows inserted")
           else np.concatenate([prev[200:], extra, prev[:200]]))
    g = chain_group(store, [prev, np.ascontiguousarray(new)], [("rows", None)])
    assert bits(reconstruct(g, store)) == bits(new)


# ------------------------------------------------------------------ IA3 and low-rank, block by block
@pytest.mark.parametrize("shape,vec_shape", [((300, 40), (1, 40)), ((300, 40), (300, 1)), ((300, 40), (40,)),
                                             ((30, 10, 4), (30, 1, 1)), ((500,), (500,)), ((), ())])
def test_ia3_scaled_in_blocks_is_the_whole_product(monkeypatch, shape, vec_shape):
    monkeypatch.setattr(ia3, "BLOCK_ELEMENTS", 64)  # many blocks
    rng = np.random.default_rng(8)
    prev = np.asarray(weights(rng, shape))
    vec = (1 + 0.01 * rng.standard_normal(vec_shape)).astype(np.float32)
    whole = (prev.astype(np.float32) * vec.astype(np.float32)).astype(np.float32)
    assert bits(ia3.scale(prev, vec)) == bits(whole)
    in_place = prev.copy()
    assert bits(ia3.scale(in_place, vec, out=in_place)) == bits(whole) == bits(in_place)


@pytest.mark.parametrize("kind", ["ia3", "low-rank"])
def test_apply_blob_in_place_equals_apply(store, kind):
    rng = np.random.default_rng(9)
    prev = weights(rng, (256, 64))
    if kind == "ia3":
        new, enc = ia3_step(prev, (1 + 0.01 * rng.standard_normal((1, 64))).astype(np.float32))
    else:
        new, enc = low_rank_step(prev, (rng.standard_normal((256, 3)) * 0.1).astype(np.float32),
                                 (rng.standard_normal((3, 64)) * 0.1).astype(np.float32))
    new = new.copy()
    new.reshape(-1)[[3, 900]] += np.float32(1e-7)  # elements the producer rounded otherwise: carried as fixes
    from theta.updates.sparse import residual

    enc.parts.update(residual(get(kind).apply({k: v for k, v in enc.parts.items() if not k.startswith("fix")},
                                              enc.params, prev), new)[0])
    blob = codec.encode_parts(enc.parts)
    want = get(kind).apply(codec.decode_parts(blob), enc.params, prev)
    assert bits(want) == bits(new)
    mine = prev.copy()
    got = get(kind).apply_blob(codec.part_blobs(blob), enc.params, mine, in_place=True)
    assert bits(got) == bits(new) and np.shares_memory(got, mine)
    assert bits(get(kind).apply_blob(codec.part_blobs(blob), enc.params, prev.copy(), in_place=False)) == bits(new)


def write_ia3(tmp_path, group: str, vec: np.ndarray):
    path = tmp_path / "ia3.safetensors"
    save_file({f"{group}/ia3": vec}, str(path))
    return sideload.UpdateData.open(path, "ia3")


def test_side_loaded_ia3_verified_block_by_block_is_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(ia3, "BLOCK_ELEMENTS", 1 << 10)
    rng = np.random.default_rng(10)
    prev = weights(rng, (512, 96))
    vec = (1 + 0.01 * rng.standard_normal((1, 96))).astype(np.float32)
    new = (prev * vec).astype(np.float32)  # torch's float32 product: the same rounding
    new.reshape(-1)[[10, 20000, 49000]] = np.nextafter(new.reshape(-1)[[10, 20000, 49000]], np.float32(1))
    data = write_ia3(tmp_path, "w", vec)
    try:
        verified = data.verify("w", new, prev, 1e-5, 1e-8)
    finally:
        data.close()
    assert verified.update_type == "ia3" and verified.encoded.params == {"fixes": 3}
    blob = codec.encode_parts(verified.encoded.parts)
    assert bits(get("ia3").apply(codec.decode_parts(blob), {}, prev)) == bits(new)


def test_side_loaded_ia3_verify_holds_no_scaled_value(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    prev = weights(rng, (4096, 512))  # 8 MiB
    vec = (1 + 0.01 * rng.standard_normal((1, 512))).astype(np.float32)
    new = (prev * vec).astype(np.float32)
    data = write_ia3(tmp_path, "w", vec)
    try:
        verified, peak = traced_peak(data.verify, "w", new, prev, 1e-5, 1e-8)
    finally:
        data.close()
    assert verified.encoded.params == {"fixes": 0}
    assert peak <= 0.5 * prev.nbytes, peak / prev.nbytes  # was 3-4 x (cast, product, result)


def test_side_loaded_ia3_on_a_wrong_base_is_refused(tmp_path):
    rng = np.random.default_rng(12)
    prev = weights(rng, (64, 16))
    vec = (1 + 0.1 * rng.standard_normal((1, 16))).astype(np.float32)
    data = write_ia3(tmp_path, "w", vec)
    try:
        with pytest.raises(UpdateDataError, match="group 'w'.*differs from the saved model"):
            data.verify("w", (weights(rng, (64, 16)) * vec).astype(np.float32), prev, 1e-5, 1e-8)
    finally:
        data.close()


# ------------------------------------------------------------------ merges read ia3 / low-rank chains block by block
@pytest.mark.parametrize("block", [1000, 4096, 1 << 20])  # blocks cutting rows anywhere, and one block
def test_group_source_streams_ia3_and_low_rank_steps_bit_for_bit(store, block):
    from theta.updates import stream

    rng = np.random.default_rng(13)
    v0 = weights(rng, (300, 40))
    v1 = tuned(rng, v0)
    v2, ia3_enc = ia3_step(v1, (1 + 0.01 * rng.standard_normal((300, 1))).astype(np.float32))
    v2 = v2.copy()
    v2.reshape(-1)[[7, 4001]] += np.float32(1e-6)  # carried as fixes
    from theta.updates.sparse import residual

    ia3_enc.parts.update(residual(ia3.scale(v1, ia3_enc.parts["ia3"]), v2)[0])
    v3, lr_enc = low_rank_step(v2, (rng.standard_normal((300, 3)) * 0.1).astype(np.float32),
                               (rng.standard_normal((3, 40)) * 0.1).astype(np.float32))
    v4 = tuned(rng, v3)
    g = chain_group(store, [v0, v1, v2, v3, v4], [("delta", None), ("ia3", ia3_enc), ("low-rank", lr_enc),
                                                  ("delta", None)])
    src = stream.source(g, store)
    assert src is not None
    got = np.concatenate([b for _, b in src.chunks(block)])
    assert bits(got) == bits(v4) == bits(reconstruct(g, store))
    assert src.checked  # the first pass checked the value's hash


@pytest.mark.parametrize("block", [999, 1 << 14, 1 << 20])
def test_group_source_streams_a_grown_mixed_chain_of_8_bit_for_bit(store, block):
    """dense, rows (grown), delta, ia3, low-rank, delta, sparse, delta: the merge reads it block by block."""
    from theta.updates import stream

    rng = np.random.default_rng(14)
    values, links = mixed_chain_of_8(rng, rows=200, cols=32, grow=9)
    g = chain_group(store, values, links)
    src = stream.source(g, store)
    assert src is not None
    got = np.concatenate([b for _, b in src.chunks(block)])
    assert bits(got) == bits(values[-1])
    assert src.checked
    again = np.concatenate([b for _, b in src.chunks(block)])  # a second pass (TIES, SLERP) reads it again
    assert bits(again) == bits(values[-1])


def test_group_source_streams_a_trimmed_chain_and_reads_moved_rows_by_position(store):
    from theta.updates import stream

    rng = np.random.default_rng(15)
    v0 = weights(rng, (300, 16))
    v1 = tuned(rng, v0)
    v2 = np.ascontiguousarray(v1[:250])
    v3 = tuned(rng, v2)
    g = chain_group(store, [v0, v1, v2, v3], [("delta", None), ("rows", None), ("delta", None)])
    got = np.concatenate([b for _, b in stream.source(g, store).chunks(1000)])
    assert bits(got) == bits(v3)
    moved = chain_group(store, [v0, np.ascontiguousarray(v0[::-1])], [("rows", None)])
    src = stream.source(moved, store)
    assert isinstance(src, stream.PositionalSource)
    assert bits(np.concatenate([b for _, b in src.chunks(1000)])) == bits(reconstruct(moved, store)) == bits(v0[::-1])


# ------------------------------------------------------------------ a partial change's unchanged frames are skipped
@pytest.mark.parametrize("op", ["zigzag", "xor", "sub"])
def test_delta_frames_of_zero_codes_are_skipped_and_the_value_is_exact(store, op, monkeypatch):
    """A few rows of a big embedding changed (Llama's reserved tokens): the delta's code words are zero in every
    frame but the last, and those frames are neither decoded into planes nor applied."""
    import ml_dtypes

    from theta.updates import delta, stream

    rng = np.random.default_rng(21)
    rows, cols = 1536, 4096  # 3 codec frames of bfloat16
    v0 = weights(rng, (rows, cols), ml_dtypes.bfloat16)
    v1 = v0.copy()
    v1[-8:] = tuned(rng, v1[-8:])
    enc = delta.DeltaUpdate().encode(v1, v0, op=op)
    assert enc.params["op"] == op
    g = chain_group(store, [v0, v1], [("delta", enc)])
    applied = []
    real = stream._uncombine
    monkeypatch.setattr(stream, "_uncombine", lambda code, *a, **k: applied.append(code.size) or real(code, *a, **k))
    src = stream.source(g, store)
    n = codec.FRAME_BYTES // 2
    got = np.concatenate([b for _, b in src.chunks(n)])
    assert bits(got) == bits(v1) == bits(reconstruct(g, store))
    assert src.checked
    assert applied == [n]  # only the last frame, the one holding the changed rows
