"""Repositories committed by the real Git-Theta 0.2.0 (fixtures/git_theta), used with theta through real git
and git-lfs: clone (LFS objects from a file:// remote through git-lfs), check out every commit, status
clean, diff, new commits on top in theta's format, migrate; Git-Theta's side-loaded workflow.

Values are compared with what Git-Theta itself checked out (expected.json: sha256 of each group's
little-endian bytes, recorded by make_fixtures.py while the real Git-Theta ran).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import zipslice
from support.gitrepo import GitEnv, Repo

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
COMMITS = [c for c in EXPECTED["commits"] if c["files"]]
HEAD_SHA = EXPECTED["commits"][-1]["sha"]

pytestmark = pytest.mark.slow  # each test clones and checks out through real git + git-lfs (~30 s)


def le_sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def checked_out(path: Path) -> dict[str, np.ndarray]:
    with zipslice.load(path) as ck:
        return {k: np.array(ck.numpy(k)) for k in ck.keys()}


@pytest.fixture()
def clone(tmp_path) -> Repo:
    """A clone (with theta installed globally) of a bare remote made from the Git-Theta bundle; the remote
    holds Git-Theta's LFS objects, which git-lfs downloads during checkout."""
    env = GitEnv.create(tmp_path)
    env.run(["git", "theta", "install"], cwd=tmp_path)
    origin = tmp_path / "origin.git"
    env.run(["git", "clone", "-q", "--bare", str(FIXTURE / "repo.bundle"), str(origin)], cwd=tmp_path)
    shutil.copytree(FIXTURE / "lfs" / "objects", origin / "lfs" / "objects")
    return env.clone(f"file://{origin}", "clone")


def assert_matches_git_theta(repo: Repo, commit: dict) -> None:
    for f, groups in commit["files"].items():
        got = checked_out(repo / f)
        assert sorted(got) == sorted(groups), f
        for name, want in groups.items():
            assert str(got[name].dtype) == want["dtype"], (f, name)
            assert list(got[name].shape) == want["shape"], (f, name)
            assert le_sha256(got[name]) == want["sha256"], (commit["subject"], f, name)


def test_every_commit_checks_out_as_git_theta_did_and_status_stays_clean(clone):
    for commit in COMMITS:
        clone.git("checkout", "-q", commit["sha"])
        assert_matches_git_theta(clone, commit)
        for f in commit["files"]:
            (clone / f).touch()  # stat changed: git runs the clean filter again
        assert clone.status() == "", commit["subject"]
        for f in commit["files"]:  # and the clean filter gives back Git-Theta's committed text, byte for byte
            text = clone.git("theta", "clean", f, input=(clone / f).read_bytes()).stdout
            assert text == clone.show(f"{commit['sha']}:{f}")


def test_checked_out_file_loads_in_torch(clone):
    sd = torch.load(clone / "model.pt", weights_only=True)
    want = COMMITS[-1]["files"]["model.pt"]
    assert sorted(sd) == sorted(want)
    for name, w in want.items():
        assert le_sha256(sd[name].numpy()) == w["sha256"]


def test_git_diff_and_theta_diff_between_git_theta_commits(clone):
    c1, c2 = COMMITS[0]["sha"], COMMITS[1]["sha"]
    out = clone.git("diff", c1, c2, "--", "model.pt").stdout.decode()
    assert "modified  emb.weight" in out and "added     fc3.weight" in out and "removed   buf.index" in out
    out = clone.theta("diff", c1, c2).stdout.decode()
    assert "3 modified, 1 added, 1 removed, 7 unchanged" in out
    out = clone.theta("diff", COMMITS[3]["sha"], HEAD_SHA, "--", "head.pt").stdout.decode()
    assert "update low-rank" in out and "2 modified" in out


def test_new_commit_on_top_is_stored_in_theta_format_and_history_mixes(clone):
    sd = torch.load(clone / "model.pt", weights_only=True)
    sd["fc1.bias"] = sd["fc1.bias"] + 1
    torch.save(sd, clone / "model.pt")
    assert clone.status() == "M model.pt"
    clone.commit("on top, with theta", "model.pt")
    assert clone.show("HEAD:model.pt").startswith(b"theta-metadata 1\n")
    assert clone.show("HEAD:head.pt").startswith(b"{")  # untouched files stay Git-Theta format
    for commit in (COMMITS[2], COMMITS[-1]):  # back into Git-Theta history and forward again
        clone.git("checkout", "-q", commit["sha"])
        assert_matches_git_theta(clone, commit)
    clone.git("checkout", "-q", "main")
    got = checked_out(clone / "model.pt")
    for name, v in sd.items():
        assert np.array_equal(got[name], v.numpy()), name
    (clone / "model.pt").touch()
    assert clone.status() == ""
    out = clone.theta("diff", HEAD_SHA, "HEAD").stdout.decode()
    assert "modified  fc1.bias" in out and "1 modified" in out
