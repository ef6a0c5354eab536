"""Chains that do not stream in one pass, read block by block by position (theta.updates.stream.PositionalSource):
a rows step that moves rows (reversed, permuted, rows deleted or inserted in the middle, duplicated), a change of
dtype on the way, delta blobs of the old ``planes`` layout. Bit for bit what rebuilding the whole value gives,
for any block size and on a second pass; a merge of such chains holds the result and a few frames, not the
three inputs. Real blobs in a real store."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from theta.base.errors import ChainError
from theta.merges import get as get_strategy
from theta.merges import plan as merge
from theta.merges.plan import MergePlan, Pending, execute
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta, GroupMeta
from theta.storage.store import LfsStore
from theta.updates import content_hash, get, steps, stream
from theta.updates.rebuild import reconstruct
from theta.updates.delta import combine, raw_words, to_planes
from theta.updates.rows import encode_sources
from theta.updates.sparse import residual
from support.traced import traced_peak
from zipslice import dtypes


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def weights(rng, shape, dtype=np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(dtype)


def tuned(rng, prev: np.ndarray) -> np.ndarray:
    return (prev.astype(np.float64) * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(prev.dtype)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)  # many frames: ranges across frames, uneven last frames
    return LfsStore(tmp_path / "objects")


def moved(rng, prev: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(new value, its row sources: index of the previous row or -1 for a new row)."""
    n, rest = prev.shape[0], prev.shape[1:]
    if how == "reversed":
        src = np.arange(n)[::-1]
    elif how == "permuted":
        src = rng.permutation(n)
    elif how == "middle rows deleted":
        src = np.concatenate([np.arange(0, n // 3), np.arange(n // 2, n)])
    elif how == "rows inserted in the middle":
        src = np.concatenate([np.arange(0, n // 2), np.full(17, -1), np.arange(n // 2, n)])
    elif how == "duplicated and new rows":
        src = np.concatenate([np.arange(n), np.arange(5, 40), np.full(9, -1), np.arange(n - 1, n - 30, -1)])
    src = src.astype(np.int64)
    new = np.empty((src.size,) + rest, prev.dtype)
    new[src >= 0] = prev[src[src >= 0]]
    new[src < 0] = weights(rng, (int((src < 0).sum()),) + rest, prev.dtype)
    return new, src


def link(store, kind: str, prev: np.ndarray, new: np.ndarray, src=None, hash_of=None):
    if kind == "rows":
        enc = get("rows").encode(new, prev) if src is None else None
        parts = enc.parts if enc is not None else {"source_gaps": encode_sources(src), "extra": new[src < 0]}
        params = {"rows": int(new.shape[0])}
    elif kind == "planes":
        parts, params, kind = {"planes": to_planes(combine(raw_words(new), raw_words(prev), "zigzag"))}, \
            {"op": "zigzag"}, "delta"
    else:
        enc = get(kind).encode(new, prev)
        parts, params = enc.parts, enc.params
    return steps.store_step(kind, parts, params, hash_of or content_hash(new), store)


def group_of(values: list, links: list, dtype_name: str | None = None) -> GroupMeta:
    last = values[-1]
    name = dtype_name or dtypes.from_numpy(last.dtype).name
    out = []
    for s, v in zip(links, values):
        params = dict(s.params)
        if v.shape != last.shape:
            params["shape"] = list(v.shape)
        if dtypes.from_numpy(v.dtype).name != name:
            params["dtype"] = dtypes.from_numpy(v.dtype).name
        out.append(dataclasses.replace(s, params=params))
    return GroupMeta(name="embed", dtype=name, shape=tuple(last.shape), hash=out[-1].hash, steps=out)


def read_all(src, block: int) -> np.ndarray:
    return np.concatenate([b for _, b in src.chunks(block)])


def ia3_change(rng, prev):
    vec = (1 + 0.01 * rng.standard_normal((1, prev.shape[1]))).astype(np.float32)
    new = (prev * vec).astype(prev.dtype)
    new.reshape(-1)[[3, 77]] += np.float32(1e-4)  # carried as fixes
    value = get("ia3").apply({"ia3": vec}, {}, prev)
    fixes, count = residual(value, new)
    return new, {"ia3": vec, **fixes}, {"fixes": count}


@pytest.mark.parametrize("how", ["reversed", "permuted", "middle rows deleted", "rows inserted in the middle",
                                 "duplicated and new rows"])
@pytest.mark.parametrize("block", [999, 4096, 1 << 20])
def test_moved_rows_in_a_mixed_chain_read_by_position_bit_for_bit(store, how, block):
    rng = np.random.default_rng(1)
    v0 = weights(rng, (300, 24))
    v1 = tuned(rng, v0)
    v2, src = moved(rng, v1, how)
    v3 = tuned(rng, v2)
    v4, ia3_parts, ia3_params = ia3_change(rng, v3)
    v5 = v4.copy()
    v5.reshape(-1)[::331] = 0.5
    v6, src2 = moved(rng, v5, "reversed")
    v7 = tuned(rng, v6)
    links = [steps.store_dense(v0, store), link(store, "delta", v0, v1), link(store, "rows", v1, v2, src),
             link(store, "delta", v2, v3),
             steps.store_step("ia3", ia3_parts, ia3_params, content_hash(v4), store),
             link(store, "sparse", v4, v5), link(store, "rows", v5, v6, src2), link(store, "delta", v6, v7)]
    g = group_of([v0, v1, v2, v3, v4, v5, v6, v7], links)
    src_ = stream.source(g, store, "m.pt")
    assert isinstance(src_, stream.PositionalSource)
    assert bits(read_all(src_, block)) == bits(v7) == bits(reconstruct(g, store))
    assert src_.checked
    assert bits(read_all(src_, block)) == bits(v7)  # a second pass (TIES, SLERP)


@pytest.mark.parametrize("block", [999, 1 << 20])
def test_low_rank_after_moved_rows_read_by_position(store, block):
    rng = np.random.default_rng(2)
    v0 = weights(rng, (200, 30))
    v1, src = moved(rng, v0, "permuted")
    R, C = (rng.standard_normal((200, 3)) * 0.01).astype(np.float32), (rng.standard_normal((3, 30)) * 0.01).astype(np.float32)
    v2 = (v1 + R @ C).astype(np.float32)  # numpy's matmul: our arithmetic differs in some elements (fixes)
    from theta.updates.low_rank import exact_encoding_by_rows

    enc, _ = exact_encoding_by_rows(v2, v1, R, C)
    links = [steps.store_dense(v0, store), link(store, "rows", v0, v1, src),
             steps.store_step("low-rank", enc.parts, enc.params, content_hash(v2), store)]
    g = group_of([v0, v1, v2], links)
    assert bits(read_all(stream.source(g, store), block)) == bits(v2) == bits(reconstruct(g, store))


@pytest.mark.parametrize("first,last", [(np.float32, np.float16), (np.float32, ml_dtypes.bfloat16),
                                        (np.float16, np.float32)], ids=str)
def test_a_change_of_dtype_is_cast_per_block(store, first, last):
    """dense and delta steps of one dtype, then the group continued in another: each step's value is cast to
    the next step's dtype, as reconstruct's whole-value cast does."""
    rng = np.random.default_rng(3)
    v0 = weights(rng, (120, 33), first)
    v1 = tuned(rng, v0)
    v2, src = moved(rng, v1, "middle rows deleted")
    final = v2.astype(last)
    links = [steps.store_dense(v0, store), link(store, "delta", v0, v1),
             link(store, "rows", v1, v2, src, hash_of=content_hash(final))]
    g = group_of([v0, v1, final], links)
    assert [s.params.get("dtype") for s in g.steps] == [dtypes.from_numpy(np.dtype(first)).name] * 2 + [None]
    src_ = stream.source(g, store)
    assert isinstance(src_, stream.PositionalSource)
    got = read_all(src_, 1000)
    assert got.dtype == np.dtype(last)
    assert bits(got) == bits(final) == bits(reconstruct(g, store))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64, np.complex128], ids=str)
def test_old_planes_deltas_read_by_position(store, dtype):
    rng = np.random.default_rng(4)
    v0 = weights(rng, (97, 61), dtype) if np.dtype(dtype).kind != "c" else \
        (weights(rng, (97, 61)) + 1j * weights(rng, (97, 61))).astype(dtype)
    v1 = (v0 * (1 + 1e-3)).astype(dtype)
    v2 = v1.copy()
    v2.reshape(-1)[::50] = 0
    v3 = (v2 * (1 - 1e-3)).astype(dtype)
    links = [steps.store_dense(v0, store), link(store, "planes", v0, v1), link(store, "sparse", v1, v2),
             link(store, "planes", v2, v3)]
    g = group_of([v0, v1, v2, v3], links)
    src_ = stream.source(g, store)
    assert isinstance(src_, stream.PositionalSource)
    for block in (1000, 1 << 20):
        assert bits(read_all(src_, block)) == bits(v3) == bits(reconstruct(g, store))


def test_a_positional_chain_whose_value_differs_from_its_hash_is_refused(store):
    rng = np.random.default_rng(5)
    v0 = weights(rng, (64, 8))
    v1, src = moved(rng, v0, "reversed")
    g = group_of([v0, v1], [steps.store_dense(v0, store), link(store, "rows", v0, v1, src)])
    forged = dataclasses.replace(g, hash="0" * 64, steps=[g.steps[0], dataclasses.replace(g.steps[1], hash="0" * 64)])
    with pytest.raises(ChainError, match="hash differs"):
        read_all(stream.source(forged, store, "m.pt"), 100)
    bad_rows = steps.store_step("rows", {"source_gaps": encode_sources(np.array([70] * 64)), "extra": v0[:0]},
                                {"rows": 64}, content_hash(v1), store)
    broken = dataclasses.replace(g, steps=[g.steps[0], bad_rows])
    with pytest.raises(ChainError, match="outside the 64 rows"):
        read_all(stream.source(broken, store, "m.pt"), 100)


@pytest.mark.parametrize("strategy", ["average", "task-arithmetic", "ties"])
def test_merge_of_moved_rows_chains_holds_the_result_not_the_inputs(tmp_path, monkeypatch, strategy):
    from theta.base import lsh
    from theta.merges.strategies import base as strategies

    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    monkeypatch.setattr(strategies, "CHUNK", 1 << 15)
    monkeypatch.setattr(merge, "_CHECK_CHUNK", 1 << 15)
    lsh._pool()  # the signature's projection table (made once per process): not the merge's memory
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(6)
    base0 = weights(rng, (2048, 1024))  # 8 MiB
    base, src = moved(rng, base0, "middle rows deleted")
    ours_v = tuned(rng, base)
    theirs_v, src2 = moved(rng, tuned(rng, base), "reversed")
    o = group_of([base0, base], [steps.store_dense(base0, store), link(store, "rows", base0, base, src)])
    a = group_of([base0, base, ours_v], [*o.steps, link(store, "delta", base, ours_v)])
    mid = tuned(rng, base)
    theirs_v = np.ascontiguousarray(mid[::-1])
    b = group_of([base0, base, mid, theirs_v], [*o.steps, link(store, "delta", base, mid),
                                                 link(store, "rows", mid, theirs_v, np.arange(mid.shape[0])[::-1])])
    for g in (o, a, b):
        assert isinstance(stream.source(g, store), stream.PositionalSource)
    meta = CheckpointMeta(format="safetensors", order=["embed"], groups={"embed": a})
    plan = MergePlan(path="m.safetensors", ours=meta, pending=[Pending("embed", a, b, o)],
                     header={"format": "safetensors", "order": ["embed"], "structure": None, "metadata": {},
                             "lsh": {}})
    plan.pending[0].strategy, plan.pending[0].params = strategy, {}
    s = get_strategy(strategy)
    want = s.merge("embed", ours_v, theirs_v, base if s.needs_ancestor else None)
    group_bytes = base.nbytes
    del base0, mid
    merged, peak = traced_peak(execute, plan, store)
    assert bits(reconstruct(merged.groups["embed"], store)) == bits(want)
    assert peak <= 1.75 * group_bytes, peak / group_bytes  # rebuilding held the three inputs and the result
