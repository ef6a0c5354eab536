"""Git-Theta's update arithmetic (theta.peers.gittheta.arithmetic.apply_update: what a Git-Theta checkout computes and
what the original-form side-load writes) adds the previous value into the product or densified update it has
just computed, in place: the same bits as ``update + previous`` (the same operands in the same order, element by
element), holding the result once instead of the update and the result (the rewrite: previous and the result,
2 x the group, instead of 3 x)."""
import numpy as np
import pytest

from theta.peers.gittheta.arithmetic import apply_update
from support.traced import traced_peak


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


@pytest.mark.parametrize("factor_dtype,prev_dtype", [(np.float32, np.float32), (np.float64, np.float32),
                                                     (np.float32, np.float64), (np.float16, np.float32)], ids=str)
def test_low_rank_in_place_gives_the_whole_expression_bits(factor_dtype, prev_dtype):
    rng = np.random.default_rng(1)
    prev = rng.standard_normal((300, 70)).astype(prev_dtype)
    prev.reshape(-1)[:4] = [np.nan, -0.0, np.inf, -np.inf]
    parts = {"R": rng.standard_normal((300, 5)).astype(factor_dtype),
             "C": rng.standard_normal((5, 70)).astype(factor_dtype)}
    got = apply_update("low-rank", parts, prev)
    want = parts["R"] @ parts["C"] + prev
    assert got.dtype == want.dtype and bits(got) == bits(want)


@pytest.mark.parametrize("data_dtype", [np.float32, np.float64, np.float16], ids=str)
def test_sparse_in_place_gives_the_whole_expression_bits(data_dtype):
    rng = np.random.default_rng(2)
    prev = rng.standard_normal((40, 30)).astype(np.float32)
    prev.reshape(-1)[:3] = [-0.0, np.nan, 5.0]
    idx = np.array([0, 1, 7, 7, 100, 1199])  # duplicates add up
    parts = {"data": rng.standard_normal(idx.size).astype(data_dtype), "indices": idx,
             "indptr": np.array([0, idx.size]), "shape": np.array([40, 30])}
    got = apply_update("sparse", parts, prev)
    dense = np.zeros(prev.size, data_dtype)
    np.add.at(dense, idx, parts["data"])
    want = dense.reshape(prev.shape) + prev
    assert got.dtype == want.dtype and bits(got) == bits(want)


def test_low_rank_holds_the_result_once():
    rng = np.random.default_rng(3)
    prev = rng.standard_normal((2048, 512)).astype(np.float32)  # 4 MiB
    parts = {"R": rng.standard_normal((2048, 8)).astype(np.float32),
             "C": rng.standard_normal((8, 512)).astype(np.float32)}
    got, peak = traced_peak(apply_update, "low-rank", parts, prev)
    assert bits(got) == bits(parts["R"] @ parts["C"] + prev)
    assert peak <= 1.1 * prev.nbytes, peak / prev.nbytes  # was 2 x: the product and the sum
