"""E2LSH + allclose: what clean treats as unchanged, and what it must detect.

Measured behaviour (also in docs/design/lsh.md): identical values -> identical signatures; float32
round-off noise -> "maybe close" and confirmed by allclose -> unchanged; real changes -> stored.
"""
import math

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch

from theta.base import lsh
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.storage.store import LfsStore

RTOL, ATOL = 1e-5, 1e-8


def weights(shape=(512, 512), seed=0, dtype=np.float32):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(dtype)


def via_float64(x):
    """A value that went through float64 arithmetic and back: float32 round-off differences."""
    return (torch.from_numpy(x).double() * 1.0000001).float().numpy()


def close(a, b):
    return lsh.maybe_close(lsh.signature(a), lsh.signature(b), a.size, math.sqrt(lsh.squares(a)), RTOL, ATOL)


def test_signature_shape_and_determinism():
    x = weights()
    s = lsh.signature(x)
    assert len(s) == lsh.K and all(isinstance(v, int) for v in s)
    assert s == lsh.signature(x.copy()) == lsh.signature(x.reshape(-1))
    assert lsh.signature(weights(seed=1)) != s


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64, np.complex64])
@pytest.mark.parametrize("n", [1, 768, 3072, lsh.POOL // 2 + 1, lsh.POOL, lsh.POOL + 5, 3 * lsh.POOL])
def test_signature_is_the_projection_of_the_fold_on_the_whole_pool(n, dtype):
    """Groups shorter than the pool project only their used part (the rest of the fold is zero): the same
    bits as projecting all of it, as every signature already stored was computed."""
    x = (np.random.default_rng(n).standard_normal(n) * 0.02).astype(dtype)
    if dtype == np.complex64:
        x = x + 1j * x[::-1]
    with np.errstate(over="ignore", invalid="ignore"):
        whole = np.einsum("pk,p->k", lsh._pool(), lsh.fold(x))
    assert lsh.signature(x) == [int(v) for v in np.rint(whole / lsh.BUCKET_WIDTH)]


def test_float_dtypes_hash_their_float32_values():
    x = weights((300,))
    for dt in (np.float16, ml_dtypes.bfloat16, np.float64):
        y = x.astype(dt)
        assert lsh.signature(y) == lsh.signature(y.astype(np.float32))
    assert lsh.hashable("bfloat16") and lsh.hashable("complex64")
    assert not lsh.hashable("int64") and not lsh.hashable("bool")


def test_nan_or_inf_gives_no_signature():
    x = weights((100,))
    x[3] = np.nan
    assert lsh.signature(x) is None
    assert lsh.maybe_close(None, [0] * 16, 100, 1.0, RTOL, ATOL)  # caller must compare exactly


@pytest.mark.parametrize("shape", [(512, 512), (3, 1000), (lsh.POOL * 3 + 17,)])
def test_round_off_noise_is_close(shape):
    x = weights(shape)
    noisy = (x * np.float32(1 + 1e-7)).astype(np.float32)
    via64 = via_float64(x)
    assert not np.array_equal(noisy, x) and not np.array_equal(via64, x)
    assert close(noisy, x) and close(via64, x)


@pytest.mark.parametrize("shape", [(512, 512), (lsh.POOL * 3 + 17,)])
def test_real_changes_are_far(shape):
    x = weights(shape)
    row = x.copy().reshape(-1)
    row[:512] += 0.01
    assert not close(x * np.float32(1.01), x)
    assert not close(row.reshape(shape), x)
    assert not close(weights(shape, seed=9), x)


def test_estimated_distance_tracks_the_true_distance():
    x = weights((256, 256))
    ratios = []
    for seed in range(20):
        d = (np.random.default_rng(100 + seed).standard_normal(x.shape) * 1e-3).astype(np.float32)
        est = lsh.estimated_distance(lsh.signature(x + d), lsh.signature(x))
        ratios.append(est / float(np.linalg.norm((x + d).astype(np.float64) - x)))
    assert 0.7 < float(np.median(ratios)) < 1.3


def clean_pair(tmp_path, old: np.ndarray, new: np.ndarray, **opts):
    tmp_path.mkdir(exist_ok=True)
    store = LfsStore(tmp_path / "o")
    p = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": old, "ids": np.arange(4)}, p)
    first = clean_checkpoint(p, store, None)
    safetensors.numpy.save_file({"w": new, "ids": np.arange(4)}, p)
    stats = CleanStats()
    second = clean_checkpoint(p, store, first, CleanOptions(**opts), stats=stats)
    return first, second, stats


@pytest.mark.parametrize("change", ["noise", "via64"])
def test_clean_keeps_previous_value_for_noise(tmp_path, change):
    x = weights((256, 300))
    new = (x * np.float32(1 + 1e-7)) if change == "noise" else via_float64(x)
    first, second, stats = clean_pair(tmp_path, x, new)
    assert stats.close == 1 and stats.written == 0
    assert second.groups["w"] == first.groups["w"]
    _, _, exact = clean_pair(tmp_path / "e", x, new, exact=True)
    assert exact.written == 1 and exact.close == 0  # exact: only identical bytes count


@pytest.mark.parametrize("change", ["one_element", "row", "scaled"])
def test_clean_detects_real_changes(tmp_path, change):
    x = weights((256, 300))
    new = x.copy()
    if change == "one_element":
        new[17, 3] += 1e-3
    elif change == "row":
        new[5] = weights((300,), seed=4)
    else:
        new = (x * np.float32(1.01)).astype(np.float32)
    first, second, stats = clean_pair(tmp_path, x, new)
    assert stats.written == 1 and stats.close == 0
    assert second.groups["w"].hash != first.groups["w"].hash


def test_int_groups_are_compared_exactly(tmp_path):
    store = LfsStore(tmp_path / "o")
    p = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"ids": np.arange(1000, dtype=np.int64)}, p)
    first = clean_checkpoint(p, store, None)
    assert first.groups["ids"].lsh is None
    ids = np.arange(1000, dtype=np.int64)
    ids[10] += 1
    safetensors.numpy.save_file({"ids": ids}, p)
    stats = CleanStats()
    clean_checkpoint(p, store, first, stats=stats)
    assert stats.written == 1


def test_measured_rates():
    """Over 50 trials each: noise always 'maybe close'; scaling by 1.01 and a changed row never."""
    x = weights((128, 256))
    noise = sum(close((x * np.float32(1 + r * 1e-7)).astype(np.float32), x) for r in np.linspace(0.5, 1, 50))
    scaled = sum(close(weights((128, 256), seed=s) * np.float32(1.01), weights((128, 256), seed=s))
                 for s in range(50))
    assert noise == 50 and scaled == 0
    assert math.isclose(lsh.BUCKET_WIDTH, 1e-6)
