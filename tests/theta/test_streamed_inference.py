"""Inferring ia3 and low-rank steps (`git theta add --update-type ia3|low-rank` without update data) block of
rows by block of rows: the same decisions and steps as the whole-group float64 implementation it replaced
(tests/support/reference_updates.py), a value rebuilt bit for bit, and no float64 copy of the group.

Tolerances: the ia3 vector's float64 sums are added block after block, so they may differ from the whole-group
sums by a few float64 ulps; the float32 vector is asserted within 1 ulp of the reference's (on these data:
the same bits) and the fixes make the stored step exact either way. The low-rank factors come from the same
randomized range finder (or, for a small side of at most 4 (rank + 8), from that side's Gram matrix instead of
an SVD of the whole difference): R @ C is asserted within 1e-6 of the largest element of the reference's R @ C,
the rank equal, and the rebuilt value bit for bit."""
import ml_dtypes
import numpy as np
import pytest

from theta.storage import codec
from theta.updates import get, ia3, low_rank
from support import reference_updates as ref
from support.traced import traced_peak


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def stored(enc):
    """The parts as a checkout decodes them (the fixes are lazy arrays read across their blocks' pieces)."""
    return codec.decode_parts(codec.encode_parts(enc.parts))


def weights(rng, shape, dtype=np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows: every accumulation crosses many blocks and blocks end mid-group."""
    monkeypatch.setattr(ia3, "BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(low_rank, "PASS_BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(low_rank, "VERIFY_BLOCK_ELEMENTS", 1500)


DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.float64]


def scaled(prev: np.ndarray, vec: np.ndarray, rng, nudge: int = 0) -> np.ndarray:
    cdt = ia3.compute_dtype(prev.dtype)
    out = (prev.astype(cdt) * vec.astype(cdt)).astype(prev.dtype)
    if nudge:  # elements the producer rounded otherwise (one ulp off): carried as fixes
        words = out.reshape(-1).view(f"u{prev.dtype.itemsize}")
        words[rng.choice(words.size, nudge, replace=False)] += 1
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,axis", [((300, 40), 1), ((300, 40), 0), ((64, 3, 5), 2), ((64, 3, 5), 1),
                                        ((999,), 0)])
def test_inferred_ia3_equals_the_whole_group_inference(small_blocks, dtype, shape, axis):
    rng = np.random.default_rng(1)
    prev = weights(rng, shape, dtype)
    vshape = tuple(n if a == axis else 1 for a, n in enumerate(shape))
    # one ulp of bfloat16/float16 is beyond the default rtol: nudged elements only where they are within it
    new = scaled(prev, 1 + 0.01 * rng.standard_normal(vshape), rng, nudge=5 if prev.itemsize >= 4 else 0)
    rtol = 1e-5 if prev.itemsize >= 4 else 1e-2  # a least-squares vector rounds a few 16-bit elements otherwise
    want = ref.ia3_encode(new, prev, rtol=rtol)
    got = get("ia3").encode(new, prev, rtol=rtol)
    assert (want is None) == (got is None)
    if want is None:  # float64: the fitted vector rounds more than 1/4 of the products otherwise; both refuse
        assert prev.dtype == np.float64
        return
    assert got.params == want.params
    got_parts = stored(got)
    w, g = want.parts["ia3"], got_parts["ia3"]
    assert w.dtype == g.dtype and w.shape == g.shape
    ulp = np.spacing(np.abs(w.astype(np.float64)).astype(w.dtype)).astype(np.float64)
    assert np.all(np.abs(w.astype(np.float64) - g.astype(np.float64)) <= ulp)
    if bits(w) == bits(g):  # the same vector: the same step, blob for blob
        assert codec.encode_parts(got.parts) == codec.encode_parts(want.parts)
    assert bits(get("ia3").apply(got_parts, got.params, prev)) == bits(new)


def test_inferred_ia3_refuses_what_the_whole_group_inference_refuses(small_blocks):
    rng = np.random.default_rng(2)
    prev = weights(rng, (200, 30))
    noisy = (prev * (1 + 1e-2 * rng.standard_normal(prev.shape))).astype(np.float32)
    assert ref.ia3_encode(noisy, prev) is None and get("ia3").encode(noisy, prev) is None
    inf = prev.copy()
    inf[3, 4] = np.inf  # a non-finite sum: that axis is skipped by both
    a, b = ref.ia3_encode(inf, prev), get("ia3").encode(inf, prev)
    assert (a is None) == (b is None)


def low_rank_change(rng, prev: np.ndarray, rank: int) -> np.ndarray:
    rows, cols = low_rank.matrix_shape(prev.shape)
    R = (rng.standard_normal((rows, rank)) * 0.01).astype(np.float32)
    C = (rng.standard_normal((rank, cols)) * 0.01).astype(np.float32)
    return (prev.reshape(rows, cols).astype(np.float32) + R @ C).astype(prev.dtype).reshape(prev.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(300, 40), (40, 300), (500, 400), (350, 450), (64, 3, 5)],
                         ids=["tall (Gram of cols)", "wide (Gram of rows)", "randomized, tall", "randomized, wide",
                              "3-d"])
@pytest.mark.parametrize("gram", [0, 8 << 20], ids=["randomized above 4(rank + 8)", "Gram up to 8 MiB"])
def test_inferred_low_rank_equals_the_whole_group_inference(small_blocks, monkeypatch, dtype, shape, gram):
    monkeypatch.setattr(low_rank, "GRAM_BYTES", gram)
    rng = np.random.default_rng(3)
    prev = weights(rng, shape, dtype)
    new = low_rank_change(rng, prev, 3)
    want = ref.low_rank_encode(new, prev)
    got = get("low-rank").encode(new, prev)
    assert (want is None) == (got is None)
    if want is None:  # float64 / bfloat16: more than 1/4 of the elements need fixes, or not within rtol: both refuse
        assert prev.dtype != np.float32
        return
    assert got.params["rank"] == want.params["rank"] == 3
    wrc = want.parts["R"].astype(np.float64) @ want.parts["C"].astype(np.float64)
    grc = got.parts["R"].astype(np.float64) @ got.parts["C"].astype(np.float64)
    assert np.max(np.abs(wrc - grc)) <= 1e-6 * np.max(np.abs(wrc))
    assert bits(get("low-rank").apply(stored(got), got.params, prev)) == bits(new)


def test_inferred_low_rank_with_a_given_rank_and_refusals_match(small_blocks):
    rng = np.random.default_rng(4)
    prev = weights(rng, (300, 40))
    new = low_rank_change(rng, prev, 2)
    got, want = get("low-rank").encode(new, prev, rank=5), ref.low_rank_encode(new, prev, rank=5)
    assert got.params["rank"] == want.params["rank"] == 5
    assert bits(get("low-rank").apply(stored(got), got.params, prev)) == bits(new)
    noisy = (prev * (1 + 1e-3 * rng.standard_normal(prev.shape))).astype(np.float32)  # full rank: refused
    assert ref.low_rank_encode(noisy, prev) is None and get("low-rank").encode(noisy, prev) is None
    bad = new.copy()
    bad[0, 0] = np.nan
    assert ref.low_rank_encode(bad, prev) is None and get("low-rank").encode(bad, prev) is None


@pytest.mark.parametrize("kind", ["ia3", "low-rank"])
def test_inference_holds_no_float64_copy_of_the_group(kind, monkeypatch):
    """The whole-group inference allocated float64 copies of the group (4 x a float32 group and more); the
    streamed one a few blocks, the factors or the vector, and the fixes (blocks small next to the group, as
    4 MiB blocks are next to real groups)."""
    monkeypatch.setattr(ia3, "BLOCK_ELEMENTS", 1 << 14)
    monkeypatch.setattr(low_rank, "PASS_BLOCK_ELEMENTS", 1 << 14)
    monkeypatch.setattr(low_rank, "VERIFY_BLOCK_ELEMENTS", 1 << 15)
    rng = np.random.default_rng(5)
    prev = weights(rng, (8192, 128))  # 4 MiB
    if kind == "ia3":
        new = scaled(prev, 1 + 0.01 * rng.standard_normal((1, 128)), rng)
    else:
        new = low_rank_change(rng, prev, 4)
    enc, peak = traced_peak(get(kind).encode, new, prev)
    assert enc is not None
    parts = stored(enc)
    assert bits(get(kind).apply(parts, enc.params, prev)) == bits(new)
    _, old_peak = traced_peak(ref.ia3_encode if kind == "ia3" else ref.low_rank_encode, new, prev)
    assert old_peak > 3 * new.nbytes  # what the test guards against
    fixes = parts["fix_values"].nbytes + parts["fix_gaps"].nbytes
    assert peak <= 0.6 * new.nbytes + 2 * fixes, (peak / new.nbytes, fixes / new.nbytes)


@pytest.mark.parametrize("pieces", [[], [0], [3, 0, 5], [1000, 1, 4096]])
def test_fixes_collected_by_block_store_the_blob_of_the_concatenated_fixes(monkeypatch, pieces):
    """The lazy fix parts (read across the blocks' pieces frame by frame) give the same blob as the arrays."""
    from theta.updates.sparse import FixCollector, residual

    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)  # frames cutting across pieces
    rng = np.random.default_rng(6)
    target = weights(rng, (sum(pieces) * 3 + 10,))
    value = target.copy()
    fixes = FixCollector(target.size, target.dtype)
    at = 0
    for n in pieces:
        idx = np.sort(rng.choice(np.arange(at, at + 3 * n), n, replace=False)) if n else np.empty(0, np.int64)
        value[idx] += np.float32(1)
        fixes.add(idx, target[idx])
        at += 3 * n
    want, count = residual(value, target)
    assert fixes.count == count
    assert codec.encode_parts(fixes.parts(lazy=True)) == codec.encode_parts(want)
    assert codec.encode_parts(fixes.parts(lazy=False)) == codec.encode_parts(want)
