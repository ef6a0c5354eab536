"""Low-rank factors of groups with more than two dimensions, as Git-Theta defines them: ``R @ C`` with numpy's
matmul (stacks of matrices whose leading dimensions broadcast), e.g. Git-Theta's end-to-end model's conv weight
[16, 3, 3, 3] with R [16, 3, 3, 2] and C [2, 3]; and theta's own matrix view beside them. No git here (through
git, with update files made by Git-Theta's own handlers: tests/e2e/test_git_theta_stacked.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from theta.base.errors import GitThetaFormatError, UpdateTypeError
from theta.base.matmul import matmul_shape
from theta.storage import codec
from theta.peers.gittheta import arithmetic as gt_arithmetic
from theta.updates.low_rank import Factors, LowRankUpdate, add_low_rank, check_factors, exact_encoding_by_rows

# (group shape, R shape, C shape): numpy's matmul gives the group's shape
STACKS = [
    ((16, 3, 3, 3), (16, 3, 3, 2), (2, 3)),        # Git-Theta's end-to-end suite (model.py's low_rank_update)
    ((16, 3, 3, 3), (3, 2), (16, 3, 2, 3)),        # R broadcast to every matrix
    ((4, 5, 6), (4, 5, 2), (4, 2, 6)),             # a matrix of R and of C per matrix of the group
    ((2, 3, 4, 5), (1, 3, 4, 2), (2, 1, 2, 5)),    # both broadcast, along different dimensions
    ((2, 3, 4, 5), (2, 1, 4, 2), (3, 2, 5)),       # C with fewer dimensions
    ((300, 40, 30), (300, 40, 3), (3, 30)),        # large enough for two threads
    ((8, 6), (8, 2), (2, 6)),                      # a matrix
    ((4, 3, 5), (4, 2), (2, 15)),                  # theta's matrix view of an N-d group
]


def numpy_value(prev: np.ndarray, R: np.ndarray, C: np.ndarray) -> np.ndarray:
    """previous + R @ C as Git-Theta computes it (its matmul, or theta's matrix view reshaped)."""
    product = R @ C
    return prev + (product if product.shape == prev.shape else product.reshape(prev.shape))


def test_matmul_shape_is_numpys():
    shapes = [(3,), (2, 3), (3, 2), (4, 2, 3), (1, 3, 2), (4, 1, 3, 2), (5, 3, 2), (2,), (1, 2), (2, 1), (0, 3)]
    for a, b in itertools.product(shapes, repeat=2):
        try:
            want = np.matmul(np.zeros(a), np.zeros(b)).shape
        except ValueError:
            with pytest.raises(ValueError):
                matmul_shape(a, b)
        else:
            assert matmul_shape(a, b) == want, (a, b)


@pytest.mark.parametrize("shape,rs,cs", STACKS, ids=lambda x: "x".join(map(str, x)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacked_factors_apply_and_encode_exactly(shape, rs, cs, dtype):
    rng = np.random.default_rng(len(shape) * 100 + len(rs) * 10 + len(cs))
    prev = rng.standard_normal(shape).astype(dtype)
    R, C = rng.standard_normal(rs).astype(dtype), rng.standard_normal(cs).astype(dtype)
    want = numpy_value(prev, R, C)
    assert check_factors(shape, R, C) is None
    ours = add_low_rank(prev, R, C)
    assert ours.shape == shape and ours.dtype == dtype
    np.testing.assert_allclose(ours, want, rtol=4 * np.finfo(dtype).eps, atol=4 * np.finfo(dtype).eps * 8)
    # the step stored for numpy's value rebuilds it bit for bit, by every path
    enc, fixes = exact_encoding_by_rows(want, prev, R, C)
    assert enc.params["rank"] == rs[-1]
    assert LowRankUpdate().apply(enc.parts, enc.params, prev).tobytes() == want.tobytes()
    blobs = {k: codec.encode_array(np.asarray(v)) for k, v in enc.parts.items()}
    assert LowRankUpdate().apply_blob(blobs, enc.params, prev.copy(), in_place=True).tobytes() == want.tobytes()
    # rows from anywhere: a block starting mid-matrix gives the same elements
    f = Factors(shape, R, C)
    rows = prev.reshape(f.rows, f.cols)
    a, b = f.rows // 3 + 1, f.rows - 1
    block = add_low_rank(rows[a:b].copy(), R, C, factors=f, first_row=a)
    assert block.tobytes() == ours.reshape(f.rows, f.cols)[a:b].tobytes()


@pytest.mark.parametrize("shape,rs,cs,problem", [
    ((16, 3, 3, 3), (16, 3, 3, 2), (2, 4), "does not give the group's shape"),
    ((16, 3, 3, 3), (16, 3, 3, 2), (3, 3), "R's last dimension (2)"),
    ((4, 5, 6), (3, 5, 2), (4, 2, 6), "do not broadcast"),
    ((4, 5, 6), (4, 5, 2), (2, 4, 2, 6), "numpy's matmul gives (2, 4, 5, 6)"),
    ((4, 5, 6), (4, 3), (3, 31), "nor are they R (4, r) and C (r, 30)"),
    ((16, 3, 3, 3), (2,), (2, 3), "at least 2 dimensions"),
    ((32,), (32, 1), (1, 1), "no low-rank form"),
])
def test_factors_that_do_not_fit_are_refused_from_their_shapes(shape, rs, cs, problem):
    R, C = np.zeros(rs, np.float32), np.zeros(cs, np.float32)
    assert problem in (check_factors(shape, R, C) or "")
    with pytest.raises(UpdateTypeError, match="low-rank update"):
        LowRankUpdate().apply({"R": R, "C": C}, {}, np.zeros(shape, np.float32))


def test_git_thetas_product_is_refused_before_it_is_made():
    """Git-Theta's R @ C of a committed blob: a pair whose product is not the previous value's shape (here 4000 x
    4000 float64, 128 MB, for a 2 x 2 group) is refused from the shapes, naming the file and the group."""
    R, C = np.ones((4000, 1)), np.ones((1, 4000))
    with pytest.raises(GitThetaFormatError) as e:
        gt_arithmetic.apply_update("low-rank", {"R": R, "C": C}, np.zeros((2, 2)), file="model.pt", group="w")
    msg = str(e.value)
    assert "gives shape [4000, 4000], not the previous value's" in msg and "model.pt" in msg and "'w'" in msg
    prev = np.zeros((16, 3, 3, 3), np.float32)
    Rs, Cs = np.ones((16, 3, 3, 2), np.float32), np.ones((2, 3), np.float32)
    assert gt_arithmetic.apply_update("low-rank", {"R": Rs, "C": Cs}, prev).tobytes() == (prev + Rs @ Cs).tobytes()
