"""Groups of more than two dimensions through Git-Theta's sparse, low-rank and ia3 updates (fixtures/git_theta/
stacked: a repository committed by the real Git-Theta 0.2.0, with the update files its own handlers made).

Two ways: a clone of Git-Theta's repository checks out what Git-Theta checked out; and the same update files,
side-loaded into a theta repository holding the same base, commit what Git-Theta committed -- stacked low-rank
factors (R [16, 3, 3, 2] and C [2, 3] on a conv weight, broadcast R or C, float64), sparse updates of N-d
groups (Git-Theta's flattened CSR, repeated unsorted indices) and ia3 vectors broadcast over stacks -- bit for
bit, each stored as an update step of its own type, and `git status` clean.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from support.gitrepo import GitEnv, Repo, clone_bundle
from support.gittheta import assert_matches_git_theta, checked_out, le_sha256

STACKED = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta" / "stacked"
EXPECTED = json.loads((STACKED / "expected.json").read_text())
BY_TAG = {c["subject"].split()[0]: c for c in EXPECTED["commits"]}
# the side-loaded commits: (tag, update type, update file made by Git-Theta's handlers)
SIDE_LOADED = [("S2", "low-rank", "lowrank.pt"), ("S3", "sparse", "sparse.pt"), ("S4", "ia3", "ia3.pt")]
N_D = ("conv.weight", "stack.weight", "bcast.weight", "wide.weight")


def values_of(tag: str) -> dict[str, np.ndarray]:
    """What Git-Theta checked out at commit ``tag`` (values.npz, keyed by the recorded sha256)."""
    with np.load(STACKED / "values.npz") as npz:
        return {name: npz[t["sha256"]] for name, t in BY_TAG[tag]["files"]["model.pt"].items()}


def last_step(repo: Repo, group: str) -> str:
    lines = [json.loads(line) for line in repo.show("HEAD:model.pt").decode().splitlines()[1:]
             if not line.startswith("#")]
    return next(g for g in lines if g.get("group") == group)["steps"][-1]["type"]


def test_fixture_holds_stacked_updates_made_by_git_theta():
    assert EXPECTED["versions"]["git-theta"] == "0.2.0"
    types = {(name, t["update_type"]) for c in EXPECTED["commits"] for f in c["files"].values()
             for name, t in f.items()}
    for name in N_D:
        assert {(name, "low-rank"), (name, "sparse"), (name, "ia3")} <= types, name
    assert (BY_TAG["S1"]["files"]["model.pt"]["conv.weight"]["shape"]) == [16, 3, 3, 3]


@pytest.fixture(scope="module")
def stacked_clone(tmp_path_factory) -> Repo:
    return clone_bundle(tmp_path_factory.mktemp("gt-stacked"), STACKED)


def test_fast_head_of_git_thetas_stacked_history_checks_out_as_it_did(stacked_clone):
    assert_matches_git_theta(stacked_clone, EXPECTED["commits"][-1])
    assert stacked_clone.status() == ""


@pytest.mark.slow
def test_every_stacked_commit_checks_out_as_git_theta_did(stacked_clone):
    for commit in EXPECTED["commits"]:
        if not commit["files"]:
            continue
        stacked_clone.git("checkout", "-q", commit["sha"])
        assert_matches_git_theta(stacked_clone, commit)
        assert stacked_clone.status() == ""
    stacked_clone.git("checkout", "-q", "main")


def theta_repo_at_s1(base: Path) -> Repo:
    """A theta repository whose model.pt holds Git-Theta's S1 checkout, committed."""
    repo = GitEnv.create(base).init("work", track=("*.pt",))
    torch.save({k: torch.from_numpy(v) for k, v in values_of("S1").items()}, repo / "model.pt")
    repo.commit("S1's values", ".gitattributes", "model.pt")
    return repo


def side_load_as_git_theta(repo: Repo, tag: str, kind: str, file: str) -> None:
    """Git-Theta's workflow with Git-Theta's update file: the work tree holds the previous version."""
    repo.theta("add", "model.pt", "--update-type", kind, "--update-data", str(STACKED / "updates" / file))
    repo.git("commit", "-q", "-m", tag)
    want = values_of(tag)
    got = checked_out(repo / "model.pt")  # the work tree, as the add left it: what is committed
    assert sorted(got) == sorted(want)
    for name, v in want.items():
        assert got[name].dtype == v.dtype and got[name].shape == v.shape, (tag, name)
        assert le_sha256(got[name]) == le_sha256(v), (tag, name)
    assert repo.status() == ""
    (repo / "model.pt").unlink()
    repo.git("checkout", "model.pt")
    assert all(le_sha256(a) == le_sha256(want[k]) for k, a in checked_out(repo / "model.pt").items()), tag
    touched = [k for k, t in BY_TAG[tag]["files"]["model.pt"].items() if t["update_type"] == kind]
    assert set(N_D) <= set(touched), tag
    for name in touched:
        assert last_step(repo, name) == kind, (tag, name)  # an update step, not a dense copy


def test_fast_git_thetas_stacked_low_rank_file_side_loads_into_theta(tmp_path):
    """The end-to-end suite's case: R [16, 3, 3, 2] and C [2, 3] for a conv weight, and the other stacks."""
    side_load_as_git_theta(theta_repo_at_s1(tmp_path), *SIDE_LOADED[0])


@pytest.mark.slow
def test_git_thetas_stacked_update_files_side_load_into_theta_one_after_another(tmp_path):
    repo = theta_repo_at_s1(tmp_path)
    for tag, kind, file in SIDE_LOADED:
        side_load_as_git_theta(repo, tag, kind, file)
