"""Git-Theta's side-loaded workflow promotes a group's dtype as numpy does (what Git-Theta 0.2.0 checks out:
fixtures/git_theta/nested, commits N4 and N6); theta's work-tree rewrite and its clean check do the same.
No git here: ``apply_to_worktree`` takes the committed values as a function."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import zipslice
from theta.base.errors import UpdateDataError
from theta.peers.gittheta.update_files import UpdateData, apply_to_worktree, git_theta_apply, promoted_dtype


def _load(path) -> dict[str, np.ndarray]:
    with zipslice.load(path) as ck:
        return {k: np.array(ck.numpy(k)) for k in ck.keys()}


@pytest.mark.parametrize("group_dtype, factor_dtype, want", [
    (torch.float32, torch.float64, np.float64),     # Git-Theta: N4/N6 of the nested fixture
    (torch.bfloat16, torch.float32, np.float32),    # Git-Theta cannot store bfloat16; the same rule
    (torch.float16, torch.float32, np.float32),     # Git-Theta cannot hash float16; the same rule
    (torch.float32, torch.float32, np.float32),     # nothing to promote
])
def test_original_form_is_rewritten_in_the_promoted_dtype(tmp_path, group_dtype, factor_dtype, want):
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(4, 3, generator=g).to(group_dtype), "b": torch.randn(3, generator=g)}
    torch.save(base, tmp_path / "model.pt")
    R, C = torch.randn(4, 2, generator=g, dtype=factor_dtype), torch.randn(2, 3, generator=g, dtype=factor_dtype)
    torch.save({"w/R": R, "w/C": C}, tmp_path / "upd.pt")
    previous = {k: v.numpy() if v.dtype != torch.bfloat16 else v.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                for k, v in base.items()}
    data = UpdateData.open(tmp_path / "upd.pt", "low-rank")
    try:
        form = apply_to_worktree(tmp_path / "model.pt", data, previous.get)
    finally:
        data.close()
    assert form.original == ["w"] and form.updated == []
    got = _load(tmp_path / "model.pt")
    expected = R.numpy() @ C.numpy() + previous["w"]  # Git-Theta's expression, numpy's promotion
    assert expected.dtype == want and got["w"].dtype == want
    assert got["w"].tobytes() == expected.tobytes()
    assert got["b"].tobytes() == previous["b"].tobytes()


def test_promoted_dtype_follows_numpy_for_every_update_type():
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert promoted_dtype("ia3", {"ia3": np.ones(3, f64)}, f32) == f64
    assert promoted_dtype("sparse", {"data": np.ones(1, f64), "indices": np.zeros(1, np.int64),
                                     "indptr": np.array([0, 1]), "shape": np.array([3])}, f32) == f64
    assert promoted_dtype("low-rank", {"R": np.ones((2, 1), f32), "C": np.ones((1, 2), f32)}, f32) == f32
    # the indices' dtype does not take part (Git-Theta densifies data only)
    assert promoted_dtype("sparse", {"data": np.ones(1, f32), "indices": np.zeros(1, np.int64),
                                     "indptr": np.array([0, 1]), "shape": np.array([3])}, f32) == f32


def test_clean_check_accepts_the_promoted_value_and_stores_it_itself(tmp_path):
    prev = np.arange(6, dtype=np.float32).reshape(2, 3)
    torch.save({"w/ia3": torch.tensor([[2.0], [0.5]], dtype=torch.float64)}, tmp_path / "upd.pt")
    data = UpdateData.open(tmp_path / "upd.pt", "ia3")
    try:
        new = git_theta_apply("ia3", data.parts("w"), prev, "w", data.path)
        assert new.dtype == np.float64
        verified = data.verify("w", new, prev, 1e-5, 1e-8)
        assert verified.update_type == "dense" and verified.value is new
        with pytest.raises(UpdateDataError, match="differs from the saved model"):
            data.verify("w", new + 1, prev, 1e-5, 1e-8)
        with pytest.raises(UpdateDataError, match="changed from float32.* to int64"):
            data.verify("w", new.astype(np.int64), prev, 1e-5, 1e-8)  # not numpy's promotion: refused
    finally:
        data.close()
