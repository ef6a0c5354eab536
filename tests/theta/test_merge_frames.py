"""A merge's result computed, encoded and hashed frame by frame (theta.updates.dense_stream): the same group --
blob, value name, fast hash, LSH signature -- as the whole-value computation stored by dense_group, bit for bit,
for every built-in arithmetic strategy and float dtype; memory a few frames, never the result; a result with
new NaN/inf stores nothing. Real blobs in a real store."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from theta.base import lsh
from theta.base.errors import MergeConflict
from theta.merges import get as get_strategy, plan as merge
from theta.merges.strategies import base as strategies
from theta.merges.plan import MergePlan, Pending, execute
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates import dense_stream, steps
from theta.updates.rebuild import reconstruct

from support.traced import traced_peak
from test_merge_streaming import chain, poked, tuned, weights

STRATEGIES = [("average", {"alpha": 0.3}), ("task-arithmetic", {"lambda_ours": 0.7}), ("ties", {"density": 0.3}),
              ("dare", {"density": 0.5, "seed": 3}), ("slerp", {"t": 0.4})]


def plan_for(store, rng, dtype, shape, strategy, params):
    base = weights(rng, shape, dtype)
    a_val = tuned(rng, base)
    b_mid = tuned(rng, base)
    b_val = poked(rng, b_mid, 50)
    b_val.reshape(-1)[:3] = 0  # finite
    o, a, b = chain(store, [base], []), chain(store, [base, a_val], ["delta"]), \
        chain(store, [base, b_mid, b_val], ["delta", "sparse"])
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": a})
    plan = MergePlan(path="m.safetensors", ours=meta, pending=[Pending("w", a, b, o, strategy, params)],
                     header={"format": "safetensors", "order": ["w"], "structure": None, "metadata": {}, "lsh": {}})
    return plan, (base, a_val, b_val)


@pytest.mark.parametrize("frame", [4096, 1 << 18], ids=["frames-cut-rows", "frames-of-whole-rows"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64], ids=str)
@pytest.mark.parametrize("strategy,params", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_the_merged_group_is_the_whole_computation_stored_bit_for_bit(tmp_path, monkeypatch, frame, dtype,
                                                                     strategy, params):
    monkeypatch.setattr(codec, "FRAME_BYTES", frame)
    monkeypatch.setattr(strategies, "CHUNK", 3000)  # blocks that straddle frames
    store = LfsStore(tmp_path / "objects")
    plan, (base, a_val, b_val) = plan_for(store, np.random.default_rng(4), dtype, (300, 257), strategy, params)
    got = execute(plan, store).groups["w"]
    s = get_strategy(strategy)
    whole = s.merge("w", a_val, b_val, base if s.needs_ancestor else None, **params)
    want = steps.dense_group(plan.pending[0].ours, whole, store)
    assert got == want  # blob oid, value name, fast hash, signature, flags
    assert np.array_equal(reconstruct(got, store).view(np.uint8), whole.view(np.uint8))
    assert store.bound(got.steps[0].blob.oid, got.hash)


def test_a_merge_holds_a_few_frames_not_the_result(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    monkeypatch.setattr(strategies, "CHUNK", 1 << 15)
    lsh._pool()  # the signature's projection table (8 MiB, made once per process): not the merge's memory
    store = LfsStore(tmp_path / "objects")
    plan, values = plan_for(store, np.random.default_rng(5), np.float32, (4096, 1024), "ties", {})  # 16 MiB
    group_bytes = values[0].nbytes
    del values
    _, peak = traced_peak(execute, plan, store)
    assert peak <= group_bytes / 2, peak / group_bytes  # ~6 MiB of frames and blocks; before: the result and more


def test_new_non_finite_values_store_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)
    store = LfsStore(tmp_path / "objects")
    plan, _ = plan_for(store, np.random.default_rng(6), np.float16, (64, 64), "task-arithmetic",
                       {"lambda_ours": 1e9})  # overflows float16
    before = sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file())
    with pytest.raises(MergeConflict, match=r"w: strategy 'task-arithmetic'.*NaN/inf"):
        execute(plan, store)
    assert sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()) == before
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]


def test_blocks_out_of_order_or_short_are_refused(tmp_path):
    store = LfsStore(tmp_path / "objects")
    x = np.arange(10, dtype=np.float32)
    with pytest.raises(Exception, match="need 10"):
        dense_stream.stage_dense(x.dtype, (10,), iter([(slice(0, 5), x[:5])]), store)
    with pytest.raises(Exception, match="out of order"):
        dense_stream.stage_dense(x.dtype, (10,), iter([(slice(5, 10), x[5:]), (slice(0, 5), x[:5])]), store)
    with pytest.raises(Exception, match="more elements"):
        dense_stream.stage_dense(x.dtype, (5,), iter([(slice(0, 10), x)]), store)
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]


def test_the_result_of_merge_blocks_is_merge_bit_for_bit():
    """merge_blocks over arrays (no store): the same bits as merge, block by block, with the inputs' blocks."""
    rng = np.random.default_rng(7)
    o = weights(rng, (123, 45))
    a, b = tuned(rng, o), tuned(rng, o)
    for name, params in STRATEGIES:
        s = get_strategy(name)
        whole = s.merge("w", a, b, o if s.needs_ancestor else None, **params)
        parts = list(s.merge_blocks("w", a, b, o if s.needs_ancestor else None, **params))
        assert np.array_equal(np.concatenate([m for _, m, _ in parts]).view(np.uint32), whole.reshape(-1).view(np.uint32))
        assert all(len(ins) == (3 if s.uses_ancestor else 2) for _, _, ins in parts)


def test_new_non_finite_block_counts_only_what_finite_inputs_became():
    m = np.array([np.inf, 1.0, np.nan, np.nan], np.float32)
    ins = [np.array([1.0, 1.0, np.nan, 1.0], np.float32), np.ones(4, np.float32)]
    assert merge.new_non_finite_block(m, ins) == 2
