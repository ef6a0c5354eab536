"""Git-Theta 0.2.0's own update handlers, case by case (fixtures/git_theta/handlers, made by make_fixtures.py
--only handlers in Git-Theta's environment): for each group (0 to 4 dimensions; float16/32/64 and integer) and
update (sparse deltas, broadcast ia3 vectors, stacked or vector low-rank factors, parts of another dtype), the
parts its format_update made and the value its apply_update gave. theta must give that value bit for bit,
both where it reads Git-Theta's commits (theta.peers.gittheta.arithmetic.apply_update) and where it takes the same
parts side-loaded from an update file (torch.save, as Git-Theta's end-to-end model writes them) and stores
them as its own steps; and refuse, naming the file and the group, what Git-Theta's apply_update refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from support.gittheta import le_sha256
from theta.base.errors import GitThetaFormatError, UpdateDataError
from theta.peers.gittheta import arithmetic as gt_arithmetic
from theta.peers.gittheta.update_files import UpdateData
from theta.storage.codec import LazyArray
from theta.updates import get as update_type

HANDLERS = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta" / "handlers"
CASES = json.loads((HANDLERS / "cases.json").read_text())["cases"]
APPLIED = [c for c in CASES if "value" in c]
REFUSED = [c for c in CASES if "apply_error" in c and c["update_type"] == "low-rank"]


@pytest.fixture(scope="module")
def arrays():
    with np.load(HANDLERS / "cases.npz") as npz:
        return {k: npz[k] for k in npz.files}


def parts_of(case: dict, arrays: dict) -> dict[str, np.ndarray]:
    return {k: arrays[f"{case['name']}/part/{k}"] for k in case["parts"]}


def update_file(tmp_path: Path, parts: dict[str, np.ndarray]) -> Path:
    path = tmp_path / "update.pt"
    torch.save({f"g/{k}": torch.from_numpy(np.array(v)) for k, v in parts.items()}, path)
    return path


def test_the_cases_cover_what_the_end_to_end_suite_and_its_neighbours_need():
    names = {c["name"] for c in APPLIED}
    assert "low-rank float32 (16, 3, 3, 3) R(16, 3, 3, 2) C(2, 3)" in names  # the suite's conv weight
    assert "ia3 float32 (16, 3, 3, 3) x (1, 3, 3, 1)" in names               # the suite's ia3 on it
    assert {c["update_type"] for c in APPLIED} == {"sparse", "low-rank", "ia3"}
    assert {c["dtype"] for c in APPLIED} >= {"float16", "float32", "float64", "int32", "int64"}
    assert {len(c["shape"]) for c in APPLIED} == {0, 1, 2, 3, 4}
    assert len(APPLIED) >= 70 and len(REFUSED) == 3


@pytest.mark.parametrize("case", APPLIED, ids=lambda c: c["name"])
def test_git_thetas_value_read_and_side_loaded(case, arrays, tmp_path):
    previous, want = arrays[f"{case['name']}/previous"], arrays[f"{case['name']}/value"]
    assert le_sha256(want) == case["value"]["sha256"]
    parts = parts_of(case, arrays)
    # reading a Git-Theta commit: its arithmetic
    got = gt_arithmetic.apply_update(case["update_type"], parts, previous)
    assert got.dtype == want.dtype and got.shape == want.shape and le_sha256(got) == le_sha256(want)
    # side-loading the same parts into theta: checked, stored as theta's steps, rebuilt bit for bit
    data = UpdateData.open(update_file(tmp_path, parts), case["update_type"])
    try:
        data.check_against({"g": previous.shape}, {"g": True})
        verified = data.verify("g", want, previous, rtol=1e-5, atol=1e-8)
    finally:
        data.close()
    if verified.encoded is None:  # stored as the value itself (a promoted dtype, or an update no step takes)
        assert verified.update_type == "dense" and le_sha256(verified.value) == le_sha256(want)
        return
    assert verified.update_type == case["update_type"]
    stored = {k: (v.read(0, v.size).reshape(v.shape) if isinstance(v, LazyArray) else np.asarray(v))
              for k, v in verified.encoded.parts.items()}
    rebuilt = update_type(verified.update_type).apply(stored, verified.encoded.params, previous)
    assert rebuilt.dtype == want.dtype and le_sha256(rebuilt) == le_sha256(want)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c["name"])
def test_what_git_theta_refuses_theta_refuses_naming_file_and_group(case, arrays, tmp_path):
    previous, parts = arrays[f"{case['name']}/previous"], parts_of(case, arrays)
    with pytest.raises(GitThetaFormatError, match="model.pt.*'g'|'g'.*model.pt"):
        gt_arithmetic.apply_update(case["update_type"], parts, previous, file="model.pt", group="g")
    path = update_file(tmp_path, parts)
    data = UpdateData.open(path, case["update_type"])
    try:
        with pytest.raises(UpdateDataError) as e:
            data.check_against({"g": previous.shape}, {"g": True})
    finally:
        data.close()
    assert str(path) in str(e.value) and "group 'g'" in str(e.value) and "does not give" in str(e.value)
