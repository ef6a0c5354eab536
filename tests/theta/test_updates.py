"""Update types (sparse, low-rank, ia3, delta, rows), the auto policy and side-loaded update files -- no git.

Exact types are checked bit for bit (raw bytes, so NaN payloads and signed zeros count); low-rank and
ia3 within their documented tolerance.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from theta.storage import codec
from theta.base.errors import ThetaError
from theta.updates import Encoded, get
from theta.updates.auto import choose
from theta.updates.delta import DeltaUpdate, changed_mask
from theta.updates.ia3 import IA3Update
from theta.updates.low_rank import LowRankUpdate, add_low_rank
from theta.updates.rows import RowsUpdate
from theta.peers.gittheta.update_files import UpdateData, UpdateDataError
from theta.updates.sparse import SparseUpdate
from support.traced import traced_peak

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]

NO_KEYFRAMES = float("inf")  # theta.keyframeRatio that never stores a keyframe (tests of auto's chains)


def raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def roundtrip(update, new, previous, **options) -> np.ndarray:
    """encode -> blob (the real codec) -> decode -> apply, as clean and smudge do."""
    enc = update.encode(new, previous, **options)
    assert isinstance(enc, Encoded)
    parts = codec.decode_parts(codec.encode_parts(enc.parts))
    out = update.apply(parts, enc.params, previous)
    assert out.dtype == new.dtype and out.shape == new.shape
    return out


def weights(rng, shape, dtype) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(dtype)


def with_specials(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    flat = a.reshape(-1)
    flat[:4] = np.array([0.0, -0.0, np.nan, np.inf], dtype=np.float32).astype(a.dtype)
    return a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_roundtrip_bit_exact(dtype):
    rng = np.random.default_rng(1)
    prev = with_specials(weights(rng, (64, 48), dtype))
    new = prev.copy()
    idx = rng.choice(new.size, 100, replace=False)
    new.reshape(-1)[idx] = weights(rng, 100, dtype)
    new.reshape(-1)[1] = np.float32(0.0).astype(dtype)              # -0.0 -> +0.0 is a change
    bits = new.reshape(-1)[2:3].view(np.uint16 if dtype.itemsize == 2 else np.uint32)
    bits += 1                                                       # another NaN payload is a change
    enc = SparseUpdate().encode(new, prev)
    assert enc.params["count"] == np.count_nonzero(changed_mask(new, prev))
    assert raw(roundtrip(SparseUpdate(), new, prev)) == raw(new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_delta_roundtrip_bit_exact(dtype):
    rng = np.random.default_rng(2)
    prev = with_specials(weights(rng, (96, 80), dtype))
    noise = 1 + 1e-3 * rng.standard_normal(prev.shape).astype(np.float32)
    new = with_specials((prev.astype(np.float32) * noise).astype(dtype))
    new.reshape(-1)[10] = -new.reshape(-1)[10]                     # a sign flip wraps the integer difference
    for op in ("zigzag", "xor", "sub"):
        assert raw(roundtrip(DeltaUpdate(), new, prev, op=op)) == raw(new)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.sampled_from(["<u1", "<u2", "<u4", "<u8"]), st.integers(0, 2**32 - 1))
def test_delta_and_sparse_exact_on_arbitrary_bits(n, word, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(np.dtype(word))
    prev = rng.integers(0, info.max, n, dtype=np.dtype(word), endpoint=True)
    new = prev.copy()
    mask = rng.random(n) < 0.3
    new[mask] = rng.integers(0, info.max, int(mask.sum()), dtype=np.dtype(word), endpoint=True)
    as_float = {"<u2": np.float16, "<u4": np.float32, "<u8": np.float64}.get(word)
    if as_float:  # every bit pattern, NaNs included, must survive
        prev, new = prev.view(as_float), new.view(as_float)
    assert raw(roundtrip(DeltaUpdate(), new, prev)) == raw(new)
    assert raw(roundtrip(SparseUpdate(), new, prev)) == raw(new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_low_rank_roundtrip_exact(dtype):
    rng = np.random.default_rng(3)
    prev = weights(rng, (120, 90), dtype)
    R = rng.standard_normal((120, 4)).astype(np.float32) * 0.01
    C = rng.standard_normal((4, 90)).astype(np.float32) * 0.01
    new = add_low_rank(prev, R, C)
    tol = dict(rtol=1e-2, atol=1e-3) if dtype.itemsize == 2 else dict(rtol=1e-5, atol=1e-6)
    enc = LowRankUpdate().encode(new, prev, **tol)                  # rank read off the singular values
    assert enc.params["rank"] == 4 and enc.parts["R"].shape == (120, 4)
    assert raw(roundtrip(LowRankUpdate(), new, prev, rank=4, **tol)) == raw(new)   # exact, fixes included
    if dtype == np.float32:   # rank too small for the change: refused, the caller stores something else
        assert LowRankUpdate().encode(new, prev, rank=2, **tol) is None


@pytest.mark.parametrize("rank", [1, 8, 64])
def test_low_rank_apply_matches_torch(rank):
    """Our element-wise evaluation gives torch's W + B @ A bit for bit (CPU, small inner dimension)."""
    import torch

    g = torch.Generator().manual_seed(rank)
    W = torch.randn(300, 200, generator=g) * 0.02
    B, A = torch.randn(300, rank, generator=g) * 0.1, torch.randn(rank, 200, generator=g) * 0.1
    ours = add_low_rank(W.numpy(), B.numpy(), A.numpy())
    assert raw(ours) == raw((W + B @ A).numpy())
    assert raw(add_low_rank(W.numpy().copy(), B.numpy().copy(), A.numpy().copy())) == raw(ours)


def test_low_rank_higher_dim_and_1d():
    rng = np.random.default_rng(5)
    prev = weights(rng, (16, 3, 3, 4), np.float32)
    R = rng.standard_normal((16, 2)).astype(np.float32) * 0.01
    C = rng.standard_normal((2, 36)).astype(np.float32) * 0.01
    new = add_low_rank(prev, R, C)
    assert raw(roundtrip(LowRankUpdate(), new, prev, rank=2)) == raw(new)
    assert LowRankUpdate().encode(weights(rng, 50, np.float32), weights(rng, 50, np.float32)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ia3_roundtrip_exact(dtype):
    rng = np.random.default_rng(6)
    prev = weights(rng, (40, 30), dtype)
    vec = (1 + 0.1 * rng.standard_normal((1, 30))).astype(np.float32)
    new = (prev.astype(np.float32) * vec).astype(dtype)
    tol = dict(rtol=1e-2, atol=0) if dtype.itemsize == 2 else dict(rtol=1e-5, atol=1e-6)
    out = roundtrip(IA3Update(), new, prev, **tol)     # the vector is inferred from the ratios
    assert raw(out) == raw(new)                         # exact: elements rounded differently are fixed
    rows_vec = (1 + 0.1 * rng.standard_normal((40, 1))).astype(np.float32)
    new_rows = (prev.astype(np.float32) * rows_vec).astype(dtype)
    enc = IA3Update().encode(new_rows, prev, **tol)
    assert enc.params["axis"] == 0 and enc.parts["ia3"].shape == (40, 1)
    # the given vector is applied with torch's arithmetic (float32, rounded): bit for bit
    assert raw(IA3Update().apply({"ia3": rows_vec}, {}, prev)) == raw(new_rows)
    assert IA3Update().encode(weights(rng, (40, 30), dtype), prev) is None  # not a rescaling


def test_rows_trim_reorder_append_exact():
    rng = np.random.default_rng(7)
    prev = with_specials(weights(rng, (1000, 16), BF16))
    trimmed = prev[:900]
    enc = RowsUpdate().encode(trimmed, prev)
    assert enc.parts["extra"].shape == (0, 16)
    assert raw(roundtrip(RowsUpdate(), trimmed, prev)) == raw(trimmed)
    keep = np.sort(rng.choice(1000, 700, replace=False))
    subset = np.concatenate([prev[keep], weights(rng, (5, 16), BF16)])
    enc = RowsUpdate().encode(subset, prev)
    assert enc.parts["extra"].shape == (5, 16)
    assert raw(roundtrip(RowsUpdate(), subset, prev)) == raw(subset)
    assert len(codec.encode_parts(enc.parts)) < 0.1 * subset.nbytes
    assert RowsUpdate().encode(weights(rng, (10, 8), BF16), prev) is None   # other row width


def test_apply_rejects_parts_that_do_not_fit():
    prev = np.zeros((4, 4), np.float32)
    with pytest.raises(ThetaError, match="sparse"):
        SparseUpdate().apply({"gaps": np.array([20], np.uint32), "values": np.ones(1, np.float32)}, {}, prev)
    with pytest.raises(ThetaError, match="low-rank"):
        LowRankUpdate().apply({"R": np.ones((3, 1), np.float32), "C": np.ones((1, 4), np.float32)}, {}, prev)
    with pytest.raises(ThetaError, match="ia3"):
        IA3Update().apply({"ia3": np.ones((5,), np.float32)}, {}, prev)
    with pytest.raises(ThetaError, match="delta"):
        DeltaUpdate().apply({"planes": np.zeros((4, 3), np.uint8)}, {"op": "zigzag"}, prev)
    with pytest.raises(ThetaError, match="previous"):
        DeltaUpdate().apply({"planes": np.zeros((4, 16), np.uint8)}, {"op": "zigzag"}, None)


def test_registry_knows_every_type():
    for name in ("dense", "sparse", "low-rank", "ia3", "delta", "rows"):
        assert get(name).name == name


# ---------------------------------------------------------------- auto


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_picks_the_smallest_exact(dtype):
    rng = np.random.default_rng(8)
    prev = weights(rng, (256, 256), dtype)
    few = prev.copy()
    few.reshape(-1)[rng.choice(few.size, 50, replace=False)] = 1
    noisy = (prev.astype(np.float32) * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(dtype)
    unrelated = weights(rng, (256, 256), dtype)
    for new, expected in ((few, "sparse"), (noisy, None), (unrelated, "dense"), (prev[:200], "rows")):
        c = choose(new, prev)
        assert raw(get(c.update_type).apply(codec.decode_parts(c.blob), c.params, prev)) == raw(new)
        assert c.size == min(c.tried.values())
        if expected:
            assert c.update_type == expected, c.tried
    c = choose(noisy, prev)
    assert c.update_type in ("delta", "sparse") and len(c.blob) < 0.7 * len(codec.encode_array(noisy))


def test_auto_counts_every_change_unless_nearly_all_of_the_sample_changed(monkeypatch):
    """The exact count of changed elements (a pass over both values) only decides whether sparse is tried:
    a fine-tune (every sampled element changed) skips it and is stored as delta; a third changed is counted
    and tried as sparse. Both rebuild bit for bit."""
    from theta.updates import auto

    counted = []
    real = auto.changed_count
    monkeypatch.setattr(auto, "changed_count", lambda a, b: counted.append(a.size) or real(a, b))
    rng = np.random.default_rng(9)
    prev = weights(rng, (1024, 1024), np.float32)  # 1 Mi elements, 4x the sample
    sample = auto.SAMPLE_SLICES * auto.SAMPLE_ELEMENTS
    tuned = (prev * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(np.float32)
    third = prev.copy()
    third.reshape(-1)[::3] += 1
    for new, counts, tried in ((tuned, [sample], {"delta"}), (third, [sample, prev.size], {"sparse", "delta"})):
        counted.clear()
        c = choose(new, prev)
        assert counted == counts and set(c.tried) == tried
        assert raw(get(c.update_type).apply(codec.decode_parts(c.blob), c.params, prev)) == raw(new)


def test_auto_samples_only_dense_against_the_delta_encoded_in_full(monkeypatch):
    """A fine-tuned group: delta is encoded once in full and one sample of the new value estimates dense (no
    sample of the delta); unrelated values: the estimate sends dense to a full encode, and it wins."""
    from theta.updates import auto

    sampled = []
    real = auto.codec.encode_parts
    monkeypatch.setattr(auto.codec, "encode_parts", lambda parts, level: sampled.append(
        {k: v.size for k, v in parts.items()}) or real(parts, level))
    rng = np.random.default_rng(10)
    prev = weights(rng, (1024, 1024), np.float32)
    sample = auto.SAMPLE_SLICES * auto.SAMPLE_ELEMENTS
    tuned = (prev * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(np.float32)
    unrelated = weights(rng, prev.shape, np.float32)
    for new, tried in ((tuned, {"delta"}), (unrelated, {"delta", "dense"})):
        sampled.clear()
        c = choose(new, prev)
        assert sampled == [{"values": sample}] and set(c.tried) == tried
        assert c.update_type == ("delta" if new is tuned else "dense")
        assert raw(get(c.update_type).apply(codec.decode_parts(c.blob), c.params, prev)) == raw(new)


def test_auto_without_previous_is_dense():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    c = choose(a, None)
    assert c.update_type == "dense" and raw(codec.decode_parts(c.blob)["values"]) == raw(a)


# ---------------------------------------------------------------- side-loaded update files


def write(tmp_path, name, tensors) -> str:
    path = tmp_path / name
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    return str(path)


@pytest.fixture
def base():
    rng = np.random.default_rng(9)
    return {"layer.q.weight": weights(rng, (64, 32), np.float32), "layer.bias": weights(rng, 32, np.float32)}


def test_sideload_low_rank(tmp_path, base):
    rng = np.random.default_rng(10)
    R = rng.standard_normal((64, 4)).astype(np.float32) * 0.1
    C = rng.standard_normal((4, 32)).astype(np.float32) * 0.1
    prev = base["layer.q.weight"]
    new = (prev + R @ C).astype(np.float32)               # torch/BLAS order: may differ in the last bit
    data = UpdateData.open(write(tmp_path, "lora.safetensors", {"layer.q.weight/R": R, "layer.q.weight/C": C}),
                           "low-rank")
    data.check_against({k: v.shape for k, v in base.items()})
    assert "layer.q.weight" in data and "layer.bias" not in data
    v = data.verify("layer.q.weight", new, prev, rtol=1e-5, atol=1e-6)
    assert v.update_type == "low-rank" and raw(v.encoded.parts["R"]) == raw(R)
    np.testing.assert_allclose(v.value, new, rtol=1e-5, atol=1e-6)
    with pytest.raises(UpdateDataError, match="layer.q.weight.*differs"):
        data.verify("layer.q.weight", new + 0.5, prev, rtol=1e-5, atol=1e-6)


def test_sideload_low_rank_bf16_rounded_elsewhere(tmp_path):
    """A bf16 model whose producer rounded the product differently: fixes, not a refusal; exact result."""
    rng = np.random.default_rng(13)
    prev = weights(rng, (64, 32), BF16)
    R = rng.standard_normal((64, 4)).astype(np.float32) * 0.05
    C = rng.standard_normal((4, 32)).astype(np.float32) * 0.05
    # the producer rounded R @ C to bf16 before adding (we round it to the factors' float32): ulps differ
    rc = (R.astype(np.float64) @ C.astype(np.float64)).astype(BF16)
    new = (prev.astype(np.float32) + rc.astype(np.float32)).astype(BF16)
    path = tmp_path / "lora.safetensors"
    safetensors.numpy.save_file({"w/R": R, "w/C": C}, str(path))
    data = UpdateData.open(path, "low-rank")
    v = data.verify("w", new, prev, rtol=1e-5, atol=1e-8)
    assert raw(LowRankUpdate().apply(codec.decode_parts(codec.encode_parts(v.encoded.parts)), v.encoded.params,
                                     prev)) == raw(new)
    assert 0 < v.encoded.params["fixes"] < new.size // 4


def test_sideload_sparse_git_theta_layout(tmp_path, base):
    prev = base["layer.q.weight"]
    flat_idx = np.array([3, 17, 400, 2047], np.int32)
    vals = np.array([0.5, -0.25, 1.0, 2.0], np.float32)
    new = prev.copy()
    new.reshape(-1)[flat_idx] += vals
    parts = {"layer.q.weight/data": vals, "layer.q.weight/indices": flat_idx,
             "layer.q.weight/indptr": np.array([0, 4], np.int32), "layer.q.weight/shape": np.array([64, 32])}
    data = UpdateData.open(write(tmp_path, "sparse.safetensors", parts), "sparse")
    data.check_against({k: v.shape for k, v in base.items()})
    v = data.verify("layer.q.weight", new, prev, rtol=0, atol=0)
    assert raw(SparseUpdate().apply(v.encoded.parts, v.encoded.params, prev)) == raw(new)
    wrong = new.copy()
    wrong.reshape(-1)[5] += 1
    with pytest.raises(UpdateDataError, match="exactly"):
        data.verify("layer.q.weight", wrong, prev, rtol=0, atol=0)


def test_sideload_ia3(tmp_path, base):
    prev = base["layer.q.weight"]
    vec = np.linspace(0.5, 1.5, 32, dtype=np.float32).reshape(1, 32)
    data = UpdateData.open(write(tmp_path, "ia3.safetensors", {"layer.q.weight/ia3": vec}), "ia3")
    v = data.verify("layer.q.weight", prev * vec, prev, rtol=1e-6, atol=0)
    assert raw(v.value) == raw(prev * vec)


@pytest.mark.parametrize("tensors,update_type,message", [
    ({"layer.q.weight/R": np.ones((64, 2), np.float32)}, "low-rank", "lacks part.*C"),
    ({"layer.q.weight/R": np.ones((64, 2), np.float32), "layer.q.weight/C": np.ones((2, 31), np.float32)},
     "low-rank", "does not give"),
    ({"nope.weight/R": np.ones((64, 2), np.float32), "nope.weight/C": np.ones((2, 32), np.float32)},
     "low-rank", "'nope.weight' is not in the checkpoint"),
    ({"layer.q.weight/A": np.ones((64, 2), np.float32)}, "low-rank", "has part 'A'"),
    ({"weights": np.ones((64, 2), np.float32)}, "low-rank", "not <group name>/<part>"),
    ({"layer.q.weight/ia3": np.ones((1, 31), np.float32)}, "ia3", "does not broadcast"),
    ({"layer.bias/R": np.ones((32, 1), np.float32), "layer.bias/C": np.ones((1, 1), np.float32)},
     "low-rank", "no low-rank form"),
    ({"layer.q.weight/ia3": np.ones(32, np.float32)}, "dense", "takes no side-loaded data"),
])
def test_sideload_bad_files_fail_clearly(tmp_path, base, tensors, update_type, message):
    path = write(tmp_path, "bad.safetensors", tensors)
    with pytest.raises(UpdateDataError, match=message):
        UpdateData.open(path, update_type).check_against({k: v.shape for k, v in base.items()})


def test_sideload_not_a_checkpoint(tmp_path):
    p = tmp_path / "junk.bin"
    p.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(UpdateDataError, match="junk.bin"):
        UpdateData.open(p, "sparse")


# ---------------------------------------------------------------- the clean policy (clean_checkpoint, no git)


def test_clean_policy_side_load_auto_and_max_chain(tmp_path):
    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.storage.metadata import dumps, loads
    from theta.model.smudge import smudge_checkpoint
    from theta.storage.store import LfsStore

    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(11)
    state = {"w": weights(rng, (96, 64), np.float32), "b": weights(rng, 64, np.float32)}
    path = tmp_path / "m.safetensors"

    def clean(st, previous, **opts):
        safetensors.numpy.save_file(st, str(path))
        # keyframes off (theta.updates.keyframe would store the tiny "b" self-contained): how auto chains steps
        opts.setdefault("keyframe_ratio", NO_KEYFRAMES)
        meta = loads(dumps(clean_checkpoint(path, store, previous, CleanOptions(**opts))))
        smudge_checkpoint(meta, store, tmp_path / "out.safetensors")
        out = safetensors.numpy.load_file(str(tmp_path / "out.safetensors"))
        assert all(raw(out[k]) == raw(v) for k, v in st.items())
        return meta

    m = clean(state, None)
    R = rng.standard_normal((96, 2)).astype(np.float32) * 0.05
    C = rng.standard_normal((2, 64)).astype(np.float32) * 0.05
    b = state["b"].copy()
    b[:3] = 0.5                                          # not in the update file: a plain change (auto)
    state = {"w": add_low_rank(state["w"], R, C), "b": b}
    lora = write(tmp_path, "lora.safetensors", {"w/R": R, "w/C": C})
    m = clean(state, m, update_type="low-rank", update_data=lora)
    assert [s.type for s in m.groups["w"].steps] == ["dense", "low-rank"]
    assert m.groups["b"].steps[0].type == "dense" and m.groups["b"].steps[1].type in ("sparse", "delta")
    types = []
    for i in range(3):
        w = state["w"].copy()
        w[i, :3] = 7.0
        state = {**state, "w": w}
        m = clean(state, m, max_chain=3)
        types.append([s.type for s in m.groups["w"].steps])
    assert types[0][:2] == ["dense", "low-rank"] and len(types[0]) == 3 and types[1] == ["dense"]
    assert len(types[2]) == 2
    with pytest.raises(UpdateDataError, match="differs"):
        clean({**state, "w": state["w"] + 1}, m, update_type="low-rank", update_data=lora)


def test_squash_meta_makes_every_group_self_contained(tmp_path):
    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.model.squash import squash_meta
    from theta.storage.store import LfsStore
    from theta.updates.rebuild import reconstruct

    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(12)
    st = {"w": weights(rng, (64, 64), BF16)}
    path = tmp_path / "m.safetensors"
    import safetensors.torch  # safetensors.numpy has no bfloat16
    import torch

    def save(a):
        safetensors.torch.save_file({"w": torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)}, str(path))

    save(st["w"])
    m = clean_checkpoint(path, store, None, CleanOptions())
    w = st["w"].copy()
    w[0, :5] = w[1, :5]
    save(w)
    m = clean_checkpoint(path, store, m, CleanOptions())
    assert len(m.groups["w"].steps) == 2
    squashed, report = squash_meta(m, store)
    assert report.rewritten == 1 and [s.type for s in squashed.groups["w"].steps] == ["dense"]
    assert raw(reconstruct(squashed.groups["w"], store)) == raw(w)


# ---------------------------------------------------------------- chains that change shape (rows)


def test_clean_chain_across_shape_changes_beyond_max_chain(tmp_path):
    """Trim / append / edit an embedding in turn through clean + smudge: each trim or append is a small
    ``rows`` step on the previous value, earlier steps record their own shape, the chain stays within
    max_chain (then a self-contained step), and every version rebuilds bit for bit, also after a
    round trip through the metadata text and with a fresh cache."""
    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.storage.metadata import dumps, loads
    from theta.model.smudge import smudge_checkpoint
    from theta.storage.store import LfsStore
    from theta.updates import step_layout
    from theta.updates.rebuild import reconstruct

    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(21)
    path = tmp_path / "m.safetensors"
    emb = weights(rng, (400, 32), np.float32)
    other = weights(rng, (32, 32), np.float32)
    metas, values, types = [], [], []

    def clean(e, previous):
        safetensors.numpy.save_file({"emb": e, "other": other}, str(path))
        meta = loads(dumps(clean_checkpoint(path, store, previous,
                                            CleanOptions(max_chain=5, keyframe_ratio=NO_KEYFRAMES))))
        smudge_checkpoint(meta, store, tmp_path / "out.safetensors")
        out = safetensors.numpy.load_file(str(tmp_path / "out.safetensors"))
        assert raw(out["emb"]) == raw(e) and out["emb"].shape == e.shape and raw(out["other"]) == raw(other)
        metas.append(meta)
        values.append(e)
        types.append([s.type for s in meta.groups["emb"].steps])
        return meta

    m = clean(emb, None)
    edits = [lambda e: e[:360],                                               # trim the vocabulary
             lambda e: np.concatenate([e, weights(rng, (8, 32), np.float32)]),  # add tokens
             lambda e: np.where(np.arange(e.shape[0])[:, None] == 5, np.float32(1), e),  # edit a row
             lambda e: np.delete(e, [3, 50, 77], axis=0),                     # remove rows in the middle
             lambda e: e[:300],
             lambda e: np.concatenate([e, weights(rng, (4, 32), np.float32)]),
             lambda e: e[:290]]
    before = store.written_bytes
    sizes = []
    for edit in edits:
        m = clean(np.ascontiguousarray(edit(values[-1])), m)
        sizes.append(store.written_bytes - before)
        before = store.written_bytes
    assert types[1] == ["dense", "rows"] and types[2] == ["dense", "rows", "rows"]
    assert types[3][-1] in ("sparse", "delta") and types[4][-1] == "rows"
    assert types[5] == ["dense"]                       # max_chain (5) reached: self-contained
    assert types[6] == ["dense", "rows"] and types[7] == ["dense", "rows", "rows"]
    assert sizes[0] < 1000 and sizes[3] < 1000 and sizes[6] < 1000   # a trim stores (almost) nothing
    assert sizes[1] < 8 * 32 * 4 + 1000                # an append stores the new rows only
    assert sizes[4] > 200 * 32 * 4 // 2                # the self-contained value (compressed)
    # earlier steps record the shape of their own value; the last has the group's
    g = metas[4].groups["emb"]
    assert [step_layout(s, g)[1] for s in g.steps] == [(400, 32), (360, 32), (368, 32), (368, 32), (365, 32)]
    assert "shape" not in g.steps[-1].params and "shape" in g.steps[0].params
    for meta, want in zip(metas, values):
        for cache in (None, {}):
            got = reconstruct(meta.groups["emb"], store, cache)
            assert got.shape == want.shape and raw(got) == raw(want)
    # a cache holding the earlier versions serves them (no blob needed for the chain's start)
    cache = {}
    reconstruct(metas[3].groups["emb"], store, cache)
    assert raw(reconstruct(metas[4].groups["emb"], store, cache)) == raw(values[4])
    # git theta squash's rewrite makes such a chain one self-contained step of the group's shape
    from theta.model.squash import squash_meta

    squashed, report = squash_meta(metas[4], store)
    assert report.rewritten == 1 and [s.type for s in squashed.groups["emb"].steps] == ["dense"]
    got = reconstruct(loads(dumps(squashed)).groups["emb"], store)
    assert got.shape == values[4].shape and raw(got) == raw(values[4])


def test_rows_not_tried_when_it_cannot_apply(tmp_path):
    """A change of row width or dtype stores the value itself (no rebuild of the previous value)."""
    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.storage.store import LfsStore

    store = LfsStore(tmp_path / "objects")
    path = tmp_path / "m.safetensors"
    rng = np.random.default_rng(22)
    e = weights(rng, (50, 8), np.float32)
    safetensors.numpy.save_file({"emb": e}, str(path))
    m = clean_checkpoint(path, store, None, CleanOptions())
    for new in (e[:, :4].copy(), e.astype(np.float16), e.reshape(-1).copy()):
        safetensors.numpy.save_file({"emb": new}, str(path))
        m2 = clean_checkpoint(path, store, m, CleanOptions())
        assert [s.type for s in m2.groups["emb"].steps] == ["dense"]
    # old metadata (no recorded shapes) still reads: a step without "shape" has its group's
    assert all("shape" not in s.params for s in m.groups["emb"].steps)


def test_rows_large_trim_is_tiny_and_wide_rows_compare_by_words():
    rng = np.random.default_rng(23)
    prev = weights(rng, (30000, 8), np.float32)
    enc = RowsUpdate().encode(prev[:29000], prev)
    assert enc.parts["source_gaps"].dtype == np.int32 and len(codec.encode_parts(enc.parts)) < 300
    # odd row widths (no wide-word view), a changed byte in the last column, int64 gaps from old blobs
    for dtype, width in ((np.uint8, 7), (np.float16, 3), (np.float32, 5)):
        p = (rng.integers(0, 250, (50, width))).astype(dtype)
        n = p[::-1].copy()
        n[0, -1] += 1
        got = roundtrip(RowsUpdate(), n, p)
        assert raw(got) == raw(n)
        assert RowsUpdate().encode(n, p).parts["extra"].shape[0] == 1
    old = RowsUpdate().encode(prev[:100], prev)
    parts = {"source_gaps": old.parts["source_gaps"].astype(np.int64), "extra": old.parts["extra"]}
    assert raw(RowsUpdate().apply(parts, old.params, prev)) == raw(prev[:100])


@pytest.mark.parametrize("grow", [False, True], ids=["trimmed", "extended"])
def test_resized_and_fine_tuned_in_one_commit_is_two_small_steps(tmp_path, grow):
    """No row survives bit-identical, so rows alone would store everything: a positional rows step, then
    sparse/delta, stores far less than dense and rebuilds bit for bit; with no room left in the chain
    for two steps the value is stored dense."""
    from theta.model.clean import CleanOptions, clean_checkpoint
    from theta.storage.store import LfsStore
    from theta.updates import step_layout
    from theta.updates.rebuild import reconstruct

    store = LfsStore(tmp_path / "objects")
    path = tmp_path / "m.safetensors"
    rng = np.random.default_rng(24)
    e = weights(rng, (2000, 64), np.float16)
    safetensors.numpy.save_file({"emb": e}, str(path))
    m0 = clean_checkpoint(path, store, None, CleanOptions())
    tuned = (e.astype(np.float32) * (1 + 1e-3 * rng.standard_normal(e.shape))).astype(np.float16)
    new = np.concatenate([tuned, weights(rng, (16, 64), np.float16)]) if grow else tuned[:1800].copy()
    safetensors.numpy.save_file({"emb": new}, str(path))
    before = store.written_bytes
    m1 = clean_checkpoint(path, store, m0, CleanOptions(keyframe_ratio=NO_KEYFRAMES))  # how auto chains steps
    g = m1.groups["emb"]
    assert [s.type for s in g.steps][:2] == ["dense", "rows"] and g.steps[2].type in ("sparse", "delta")
    assert [step_layout(s, g)[1] for s in g.steps] == [(2000, 64), new.shape, new.shape]
    dense_size = len(codec.encode_array(new))
    assert store.written_bytes - before < 0.6 * dense_size
    assert raw(reconstruct(g, store)) == raw(new) and reconstruct(g, store).shape == new.shape
    m2 = clean_checkpoint(path, store, m0, CleanOptions(max_chain=2, keyframe_ratio=NO_KEYFRAMES))
    assert [s.type for s in m2.groups["emb"].steps] == ["dense"]


def test_step_layout_records_and_defaults():
    from theta.base.errors import MetadataError
    from theta.storage.metadata import GroupMeta, Step
    from theta.storage.store import BlobRef
    from theta.updates import relayout_steps, step_layout

    ref = BlobRef("0" * 64, 1)
    g = GroupMeta(name="e", dtype="float32", shape=(10, 4), hash="h",
                  steps=[Step("dense", ref, {"shape": [12, 4]}, "a"), Step("rows", ref, {"rows": 10}, "b")])
    assert [step_layout(s, g) for s in g.steps] == [("float32", (12, 4)), ("float32", (10, 4))]
    # continued by a group of another shape/dtype: every step records what differs, and drops what doesn't
    out = relayout_steps(g, "float16", (12, 4))
    assert [s.params for s in out] == [{"dtype": "float32"}, {"rows": 10, "shape": [10, 4], "dtype": "float32"}]
    assert [(s.blob, s.hash) for s in out] == [(s.blob, s.hash) for s in g.steps]
    bad = Step("dense", ref, {"shape": "wide"}, "a")
    with pytest.raises(MetadataError, match="bad 'shape'"):
        step_layout(bad, g)


def test_sideload_low_rank_verifies_row_block_by_row_block(tmp_path, monkeypatch):
    """Checking a LoRA against the saved model holds neither the value it gives nor float64 copies: beyond the
    new and previous values (the caller's), a few row blocks and the fixes."""

    from theta.updates import low_rank
    from theta.peers.gittheta import update_files as sideload

    monkeypatch.setattr(low_rank, "VERIFY_BLOCK_ELEMENTS", 1 << 16)  # blocks small next to the group, as in use
    monkeypatch.setattr(sideload, "_AGREE_CHUNK", 1 << 16)
    rng = np.random.default_rng(14)
    prev = weights(rng, (4096, 1024), np.float32)  # 16 MiB
    R = rng.standard_normal((4096, 8)).astype(np.float32) * 0.05
    C = rng.standard_normal((8, 1024)).astype(np.float32) * 0.05
    new = (prev + R @ C).astype(np.float32)  # BLAS's order: some elements differ in the last bit
    path = tmp_path / "lora.safetensors"
    safetensors.numpy.save_file({"w/R": R, "w/C": C}, str(path))
    data = UpdateData.open(path, "low-rank")
    data.parts("w")  # read the factors before measuring
    v, peak = traced_peak(data.verify, "w", new, prev, rtol=1e-5, atol=1e-8)
    assert raw(LowRankUpdate().apply(codec.decode_parts(codec.encode_parts(v.encoded.parts)), v.encoded.params,
                                     prev)) == raw(new)
    assert v.encoded.params["fixes"] < new.size // 4
    fixes_bytes = v.encoded.params["fixes"] * (4 + 8)
    # before: the value (1 group) and, with fixes, three float64 copies (6 groups)
    assert peak <= 0.25 * new.nbytes + fixes_bytes, (peak / new.nbytes, fixes_bytes / new.nbytes)
