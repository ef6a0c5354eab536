"""theta.save_to_git / theta.load_from_git with real git and git-lfs: a state dict committed without writing the
checkpoint, read back bit for bit, only changed groups stored, the user's index and work tree left honest."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import theta
import zipslice
from support.checkpoints import make_state
from support.gitrepo import GitEnv, Repo, clone_bundle
from theta.model import framewise
from theta.base.errors import CheckpointError, GitError, NotARepositoryError, StagedChangesError, ThetaError, TrackError
from theta.inprocess.commit import commit_checkpoint
from theta.storage.metadata import loads


@pytest.fixture(scope="module")
def shared_env(tmp_path_factory) -> GitEnv:
    """A git environment of its own with theta installed globally (one per module: installing costs seconds)."""
    env = GitEnv.create(tmp_path_factory.mktemp("inprocess"))
    env.run(["git", "theta", "install"], cwd=env.home)
    return env


@pytest.fixture
def genv(shared_env, monkeypatch):
    """``shared_env`` made this process's environment: the calls under test run git in-process."""
    for k, v in shared_env.env.items():
        monkeypatch.setenv(k, v)
    return shared_env


@pytest.fixture
def repo(genv, monkeypatch, request) -> Repo:
    """A fresh repository (one commit, theta not tracking anything yet), the current directory."""
    r = genv.init(f"work-{request.node.name}".replace("[", "-").replace("]", ""), theta=False)
    (r / "notes.txt").write_text("notes\n")
    r.commit("start", "notes.txt")
    monkeypatch.chdir(r.path)
    return r


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_loads_back(lsd, sd) -> None:
    assert list(lsd) == list(sd)
    for k, v in sd.items():
        assert same_bits(lsd[k], v), k


def lfs_bytes(repo: Repo) -> dict[str, int]:
    return {oid: repo.lfs_object(oid).stat().st_size for oid in repo.lfs_objects()}


def state(seed: int) -> OrderedDict:
    sd = make_state(seed)
    sd._metadata = OrderedDict({"": {"version": 1}})  # as model.state_dict() carries it
    return sd


def test_save_then_load_bit_for_bit_without_writing_the_file(repo):
    sd = state(1)
    sha = theta.save_to_git(sd, "model.pt", "first version")
    assert isinstance(sha, str) and sha == sha.hexsha == repo.out("rev-parse", "HEAD")
    assert repo.out("log", "-1", "--format=%s") == "first version"
    assert repo.out("show", "--format=", "--name-only", "HEAD").splitlines() == [".gitattributes", "model.pt"]
    assert (repo / ".gitattributes").read_text() == "model.pt filter=theta diff=theta merge=theta\n"
    assert not (repo / "model.pt").exists()
    # the index holds the committed version; the work tree honestly lacks it
    assert repo.git("diff", "--cached", "--quiet", check=False).returncode == 0
    assert repo.status() == "D model.pt"
    with theta.load_from_git(sha, "model.pt") as lsd:
        assert isinstance(lsd, zipslice.LazyCheckpoint)
        assert_loads_back(lsd, sd)
    # checked out, the file is what torch.save(sd) writes, and git sees it unchanged
    repo.git("checkout", "--", "model.pt")
    assert repo.status() == ""
    back = torch.load(repo / "model.pt", weights_only=True)
    assert type(back) is OrderedDict and back._metadata == sd._metadata
    assert all(same_bits(back[k], v) for k, v in sd.items())


def test_second_save_stores_only_the_changed_groups(repo, monkeypatch):
    monkeypatch.setenv("GIT_THETA_KEYFRAME_RATIO", "inf")  # a small step on the chain, not a new keyframe
    sd = state(1)
    theta.save_to_git(sd, "model.pt", "v1")
    before = lfs_bytes(repo)
    v2 = OrderedDict(sd)
    v2["layers.1.mlp.weight"] = torch.randn(64, 32, generator=torch.Generator().manual_seed(9))  # all new values
    v2["layers.2.attn.weight"] = sd["layers.2.attn.weight"] + 1e-3                               # a small step
    saved = commit_checkpoint(v2, "model.pt", "v2")
    assert (saved.stats.groups, saved.stats.unchanged, saved.stats.written) == (len(sd), len(sd) - 2, 2)
    new = {oid: n for oid, n in lfs_bytes(repo).items() if oid not in before}
    meta = loads(repo.show("HEAD:model.pt"))
    changed = {s.blob.oid for k in ("layers.1.mlp.weight", "layers.2.attn.weight")
               for s in meta.groups[k].steps} - set(before)
    assert set(new) == changed  # nothing stored for the unchanged groups
    assert sum(new.values()) == saved.stats.new_blob_bytes < 64 * 32 * 4 + 32 * 32 * 4
    assert meta.groups["layers.2.attn.weight"].steps[-1].type != "dense"  # stored as a change
    assert meta.groups["embed.weight"] == loads(repo.show("HEAD~1:model.pt")).groups["embed.weight"]
    with theta.load_from_git("HEAD", "model.pt") as lsd:
        assert_loads_back(lsd, v2)
    with theta.load_from_git("HEAD~1", "model.pt") as lsd:
        assert_loads_back(lsd, sd)


def test_tag_and_a_commit_that_sweeps_nothing_else_in(repo):
    (repo / "notes.txt").write_text("staged edit\n")
    repo.git("add", "notes.txt")
    sha = theta.save_to_git(state(1), "model.pt", "tagged", tag="v1")
    assert repo.out("rev-parse", "v1^{commit}") == sha
    assert repo.out("show", "--format=", "--name-only", sha).splitlines() == [".gitattributes", "model.pt"]
    assert repo.out("diff", "--cached", "--name-only") == "notes.txt"  # still staged, not committed
    assert repo.out("reflog", "-1", "--format=%gs") == "commit: tagged"
    # an existing or invalid tag is refused before anything is stored or committed
    objects = repo.lfs_objects()
    for bad, problem in (("v1", "tag 'v1' already exists"), ("a..b", "not a valid tag name")):
        with pytest.raises(GitError, match=problem):
            theta.save_to_git(state(2), "model.pt", "again", tag=bad)
    assert repo.out("rev-parse", "HEAD") == sha and repo.lfs_objects() == objects


def test_refusals_leave_the_repository_as_it_was(repo, tmp_path):
    theta.save_to_git(state(1), "model.pt", "v1")

    def refused(error, match, *args, **kwargs):
        before = repo.out("rev-parse", "HEAD"), repo.lfs_objects(), repo.out("ls-files", "-s"), repo.status()
        with pytest.raises(error, match=match):
            commit_checkpoint(*args, **kwargs)
        assert (repo.out("rev-parse", "HEAD"), repo.lfs_objects(), repo.out("ls-files", "-s"), repo.status()) == before

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    refused(NotARepositoryError, "not inside a git work tree", state(2), outside / "model.pt", "m")
    refused(CheckpointError, "must be a mapping", [torch.ones(1)], "model.pt", "m")
    refused(CheckpointError, "entry 'x': a object value", {"x": object()}, "model.pt", "m")
    refused(ThetaError, "not supported", state(2), "model.pt", "m", fmt="flax")
    # another tool's filter, and a file git already holds without theta
    (repo / ".gitattributes").write_text((repo / ".gitattributes").read_text() + "*.bin filter=lfs\n")
    repo.commit("lfs", ".gitattributes")
    refused(TrackError, "tracked by filter=lfs", state(2), "weights.bin", "m")
    (repo / "plain.pt").write_bytes(b"plain")
    repo.commit("plain", "plain.pt")
    refused(TrackError, "committed without theta", state(2), "plain.pt", "m")
    # staged changes of the user's to that path
    repo.git("checkout", "--", "model.pt")
    torch.save(state(3), repo / "model.pt")
    repo.git("add", "model.pt")
    refused(StagedChangesError, "model.pt has staged changes", state(2), "model.pt", "m")
    repo.git("reset", "-q", "--", "model.pt")
    # an unresolved conflict on that path, and a merge in progress
    oid = repo.out("rev-parse", ":model.pt")
    repo.git("update-index", "--index-info", input=(f"0 {'0' * 40}\tmodel.pt\n100644 {oid} 1\tmodel.pt\n"
                                                    f"100644 {oid} 2\tmodel.pt\n").encode())
    refused(StagedChangesError, "unresolved merge conflict", state(2), "model.pt", "m")
    repo.git("reset", "-q", "--", "model.pt")
    repo.git("checkout", "-q", "-b", "side")
    (repo / "notes.txt").write_text("side\n")
    repo.commit("side", "notes.txt")
    repo.git("checkout", "-q", "main")
    (repo / "notes.txt").write_text("main\n")
    repo.commit("main", "notes.txt")
    assert repo.git("merge", "side", check=False).returncode != 0
    refused(ThetaError, "a merge is in progress", state(2), "model.pt", "m")


def test_a_placeholder_of_the_previous_version_becomes_the_new_ones(repo):
    theta.save_to_git(state(1), "model.pt", "v1")
    repo.git("checkout", "--", "model.pt", extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    assert (repo / "model.pt").read_bytes() == repo.show("HEAD:model.pt") and repo.status() == ""
    saved = commit_checkpoint(state(2), "model.pt", "v2")
    assert saved.worktree == "placeholder"
    assert (repo / "model.pt").read_bytes() == repo.show("HEAD:model.pt")
    assert repo.status() == ""


def test_checkout_writes_the_committed_version(repo):
    sd = state(1)
    saved = commit_checkpoint(sd, "sub/model.pt", "v1", checkout=True)
    assert saved.worktree == "checked-out" and repo.status() == ""
    back = torch.load(repo / "sub/model.pt", weights_only=True)
    assert all(same_bits(back[k], v) for k, v in sd.items())
    # the file's own changes are never overwritten
    torch.save(state(5), repo / "sub/model.pt")
    with pytest.raises(ThetaError, match="changes in the work tree that checkout=True would overwrite"):
        theta.save_to_git(state(2), "sub/model.pt", "v2", checkout=True)
    theta.save_to_git(state(2), "sub/model.pt", "v2")  # without checkout: committed, the file left as it was
    assert repo.status() == "M sub/model.pt"
    assert all(same_bits(torch.load(repo / "sub/model.pt", weights_only=True)[k], v) for k, v in state(5).items())


@pytest.mark.parametrize("name", ["w.safetensors", "w.h5"])
def test_flat_formats_from_the_extension(repo, name):
    sd = {"x": np.arange(12, dtype=">f4").reshape(3, 4), "y": np.ones(3, dtype=np.int16),
          "z": torch.randn(5, dtype=torch.bfloat16)}
    saved = commit_checkpoint(sd, name, "flat")
    assert saved.format == zipslice.format_for_path(name)
    with theta.load_from_git("HEAD", name) as lsd:
        assert lsd.format == saved.format
        assert sorted(lsd) == sorted(sd)
        for k, v in sd.items():
            assert same_bits(lsd[k], torch.from_numpy(v.astype(v.dtype.newbyteorder("<"))) if k != "z" else v), k
    repo.git("checkout", "--", name)
    assert repo.status() == ""
    with pytest.raises(ThetaError, match="entry 'n'|cannot|structure|value"):
        commit_checkpoint({"x": torch.ones(2), "n": 3}, name, "a plain value has no place in a flat format")


def test_a_group_bigger_than_the_frame_threshold_streams(repo, monkeypatch):
    """A group above theta.model.framewise.STREAM_BYTES (lowered here to 1 MiB) is cleaned frame by frame from the
    caller's tensor, and records exactly what the whole-group path records."""
    g = torch.Generator().manual_seed(3)
    sd = OrderedDict(big=torch.randn(1 << 19, generator=g), small=torch.randn(10, generator=g))  # 2 MiB, 40 B
    v2 = OrderedDict(big=sd["big"] + 1e-4, small=sd["small"])
    whole = []
    for v, msg in ((sd, "v1"), (v2, "v2")):
        commit_checkpoint(v, "whole.pt", msg)
        whole.append(repo.show("HEAD:whole.pt").replace(b"whole.pt", b""))
    passes = []
    real = framewise.first_pass
    monkeypatch.setattr(framewise, "STREAM_BYTES", 1 << 20)
    monkeypatch.setattr(framewise, "first_pass", lambda frames, *a, **k: passes.append(frames.key) or real(frames, *a, **k))
    streamed = []
    for v, msg in ((sd, "v1"), (v2, "v2")):
        commit_checkpoint(v, "streamed.pt", msg)
        streamed.append(repo.show("HEAD:streamed.pt").replace(b"streamed.pt", b""))
    assert passes == ["big", "big"]
    assert streamed == whole  # the same metadata, so the same blobs
    assert loads(streamed[1]).groups["big"].steps[-1].type != "dense"  # the small step stored as a change
    with theta.load_from_git("HEAD", "streamed.pt") as lsd:
        assert_loads_back(lsd, v2)


def test_a_lazy_checkpoint_is_committed_as_it_is_and_stays_open(repo, tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "trainer-wrote.safetensors"
    sd = {"a": torch.randn(4, 4), "b": torch.arange(3)}
    save_file(sd, src, metadata={"format": "pt"})
    with zipslice.load(src) as lsd:
        theta.save_to_git(lsd, "model.safetensors", "from a file")
        assert same_bits(lsd["a"], sd["a"])  # still open
    repo.git("checkout", "--", "model.safetensors")
    assert repo.status() == "" and (repo / "model.safetensors").read_bytes() == src.read_bytes()


def test_load_from_git_pickles_as_the_state_dict_and_takes_git_theta_arguments(repo, tmp_path):
    sd = state(1)
    first = theta.save_to_git(sd, "model.pt", "v1")
    theta.save_to_git(state(2), "model.pt", "v2")

    class GitPythonCommit:  # what Git-Theta's save_to_git returned: load_from_git took it back
        hexsha = first

    lsd = theta.load_from_git(GitPythonCommit(), "model.pt", checkpoint_type="pytorch")
    torch.save(lsd, tmp_path / "copy.pt")
    back = torch.load(tmp_path / "copy.pt", weights_only=True)
    assert type(back) is OrderedDict and list(back) == list(sd)
    assert all(same_bits(back[k], v) for k, v in sd.items())
    with pytest.raises(ThetaError, match="checkpoint type 'tf'"):
        theta.load_from_git(first, "model.pt", checkpoint_type="tf")
    theta.load_from_git(first, "model.pt", checkout=True)  # Git-Theta's checkout: `git checkout REV`
    assert repo.out("rev-parse", "HEAD") == first
    assert repo.git("symbolic-ref", "-q", "HEAD", check=False).returncode != 0  # detached, as Git-Theta left it


@pytest.mark.slow  # a clone of the Git-Theta fixture with its LFS objects: ~10 s on a loaded 2-core machine
def test_versions_git_theta_committed_load_and_take_a_save_on_top(tmp_path, monkeypatch):
    import hashlib
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta"
    expected = [c for c in json.loads((fixture / "expected.json").read_text())["commits"] if c["files"]]
    clone = clone_bundle(tmp_path, fixture)
    for k, v in clone.env.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(clone.path)
    # every version Git-Theta committed (dense, sparse, low-rank and ia3 chains) loads as Git-Theta checked it out
    for commit in expected:
        for f, groups in commit["files"].items():
            with theta.load_from_git(commit["sha"], f) as lsd:
                assert sorted(lsd) == sorted(groups), (commit["subject"], f)
                for name, want in groups.items():
                    got = lsd.numpy(name)
                    assert str(got.dtype) == want["dtype"] and list(got.shape) == want["shape"]
                    assert hashlib.sha256(bytes(lsd.read_bytes(name))).hexdigest() == want["sha256"], name
    first = expected[0]
    lsd = theta.load_from_git(first["sha"], "model.pt")
    torch.save(lsd, tmp_path / "first.pt")
    assert sorted(torch.load(tmp_path / "first.pt", weights_only=True)) == sorted(first["files"]["model.pt"])
    sd = torch.load(clone / "model.pt", weights_only=True)
    sd["fc1.bias"] = sd["fc1.bias"] + 1
    theta.save_to_git(sd, "model.pt", "on top of Git-Theta, from Python")
    assert clone.show("HEAD:model.pt").startswith(b"theta-metadata 3\n")
    clone.git("checkout", "--", "model.pt")
    assert clone.status() == ""
    back = torch.load(clone / "model.pt", weights_only=True)
    assert list(back) == list(sd) and all(same_bits(back[k], v) for k, v in sd.items())
