"""The fault suite: the filter killed with SIGKILL at several points of `git add` and `git checkout`, a full
disk (a small tmpfs, when the machine lets us mount one), and two adds sharing one store at once.

After any of these: git's index is intact, no object sits under its final name with a wrong hash, no temp
file is left (after the next theta run at the latest: a killed process's scratch directory is swept by the
next one), no partial file appears under the real name, and a retry works, bit for bit.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from support.checkpoints import assert_same_checkpoint, make_state, save_pt
from support.crafted import leftovers, limited_git
from support.gitrepo import GitEnv


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def _objects_ok(repo) -> None:
    d = repo.git_common_dir() / "lfs" / "objects"
    for p in d.glob("??/??/*"):
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, f"{p} holds other bytes than its name"
    tmp = repo.git_common_dir() / "lfs" / "tmp"
    assert not tmp.exists() or not any(tmp.iterdir()), f"left in lfs/tmp: {list(tmp.iterdir())}"


def _v2(sd):
    v2 = OrderedDict(sd)
    v2["layers.0.mlp.weight"] = sd["layers.0.mlp.weight"] * 2
    v2["embed.weight"] = torch.randn(64, 32, generator=torch.Generator().manual_seed(99))
    return v2


# two points in the default run, all under -m slow
@pytest.mark.parametrize("point", [pytest.param("clean:received", marks=pytest.mark.slow), "store:written",
                                   pytest.param("store:published", marks=pytest.mark.slow),
                                   pytest.param("store:published:2", marks=pytest.mark.slow), "clean:done"])
def test_kill_during_add(genv, point):
    repo = genv.init("work")
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    index = (repo.git_common_dir() / "index").read_bytes()
    v2 = _v2(v1)
    save_pt(repo / "model.pt", v2)
    res = limited_git(repo, "add", "model.pt", extra_env={"GIT_THETA_FAULT": point})
    assert res.returncode != 0, res.err
    assert (repo.git_common_dir() / "index").read_bytes() == index  # git left the index as it was
    assert not (repo.git_common_dir() / "index.lock").exists()
    _objects_ok(repo)
    repo.git("add", "model.pt")  # the retry works, and the next theta run swept what the killed one left
    _objects_ok(repo)
    assert leftovers(repo) == []
    repo.commit("v2")
    os.unlink(repo / "model.pt")
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", v2)
    assert repo.status() == ""


@pytest.mark.parametrize("point", [pytest.param("smudge:fetched", marks=pytest.mark.slow), "smudge:group:3",
                                   pytest.param("smudge:group", marks=pytest.mark.slow),
                                   pytest.param("smudge:done", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_kill_during_checkout(genv, point, name):
    from safetensors.torch import save_file

    repo = genv.init("work")
    sd = make_state(2)
    if name.endswith(".pt"):
        save_pt(repo / name, sd)
    else:
        save_file(dict(sd), str(repo / name))
    repo.commit("v1", ".gitattributes", name)
    index = (repo.git_common_dir() / "index").read_bytes()
    os.unlink(repo / name)
    res = limited_git(repo, "checkout", "--", name, extra_env={"GIT_THETA_FAULT": point})
    assert res.returncode != 0, res.err
    assert not (repo / name).exists(), "a partial file under the real name"
    assert (repo.git_common_dir() / "index").read_bytes() == index
    assert not [p for p in repo.path.iterdir() if p.name.startswith(f".{name}")]  # no temp in the work tree
    _objects_ok(repo)
    repo.git("checkout", "--", name)
    assert leftovers(repo) == []
    if name.endswith(".pt"):
        assert_same_checkpoint(repo / name, sd)
    else:
        from safetensors.torch import load_file

        got = load_file(str(repo / name))
        assert list(got) == list(sd) or sorted(got) == sorted(sd)
        for k, v in sd.items():
            assert got[k].dtype == v.dtype and torch.equal(_bytes(got[k]), _bytes(v)), k
    assert repo.status() == ""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_two_adds_sharing_one_store_at_once(genv):
    """Two worktrees of one repository share .git/lfs: adds running at the same time store shared groups
    once and both succeed."""
    repo = genv.init("work")
    save_pt(repo / "model.pt", make_state(3))
    repo.commit("base", ".gitattributes", "model.pt")
    other = genv.home.parent / "other"
    repo.git("worktree", "add", "-q", "-b", "other", str(other))
    a, b = make_state(4, n_layers=6), make_state(4, n_layers=6)
    b["head.bias"] = torch.ones(64, dtype=torch.bfloat16)  # everything else shared with a
    save_pt(repo / "model.pt", a)
    save_pt(other / "model.pt", b)
    procs = [subprocess.Popen(["git", "add", "model.pt"], cwd=d, env=genv.env, stderr=subprocess.PIPE)
             for d in (repo.path, other)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    _objects_ok(repo)
    repo.commit("a")
    genv.run(["git", "commit", "-q", "-m", "b"], cwd=other)
    for d, sd in ((repo.path, a), (other, b)):
        os.unlink(d / "model.pt")
        genv.run(["git", "checkout", "--", "model.pt"], cwd=d)
        assert_same_checkpoint(d / "model.pt", sd)


# ---------- a full disk ----------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _random_state(mib: int) -> dict:
    g = torch.Generator().manual_seed(mib)
    return {"w": torch.randn(mib << 18, generator=g)}  # incompressible: mib MiB of float32


def _fill(directory: Path, leave: int) -> Path:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.truncate(0)
        chunk = b"\0" * (1 << 20)
        left = max(0, free - leave)
        while left > 0:
            n = f.write(chunk[: min(len(chunk), left)])
            left -= n
    return filler


def test_add_on_a_full_disk_fails_cleanly(genv, small_disk):
    repo_path = small_disk / "repo"
    genv.run(["git", "init", "-q", str(repo_path)], cwd=genv.home)
    from support.gitrepo import Repo

    repo = Repo(repo_path, genv)
    repo.theta("install", "--local")
    repo.theta("track", "*.pt")
    repo.commit("attrs", ".gitattributes")
    torch.save(_random_state(8), repo / "model.pt")
    _fill(small_disk, leave=4 << 20)  # room for neither the blob nor git's copy
    index = (repo.git_common_dir() / "index").read_bytes()
    res = limited_git(repo, "add", "model.pt")
    assert res.returncode != 0 and "Traceback" not in res.err, res.err
    assert "No space left" in res.err or "cannot write" in res.err, res.err
    assert (repo.git_common_dir() / "index").read_bytes() == index
    _objects_ok(repo)
    (small_disk / "filler").unlink()
    repo.git("add", "model.pt")
    assert leftovers(repo) == []


def test_checkout_on_a_full_disk_leaves_nothing_under_the_real_name(genv, small_disk):
    repo_path = small_disk / "repo"
    genv.run(["git", "init", "-q", str(repo_path)], cwd=genv.home)
    from support.gitrepo import Repo

    repo = Repo(repo_path, genv)
    repo.theta("install", "--local")
    repo.theta("track", "*.pt")
    sd = _random_state(6)
    torch.save(sd, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    os.unlink(repo / "model.pt")
    filler = _fill(small_disk, leave=3 << 20)  # the blob is local; the 6 MiB file cannot fit
    res = limited_git(repo, "checkout", "--", "model.pt")
    err = res.err.decode(errors="replace") if isinstance(res.err, bytes) else res.err
    assert "Traceback" not in err and "model.pt" in err, err
    # never a partial checkpoint under the real name, and the command fails: either theta refused up front
    # (nothing there) or it left the placeholder (its metadata text, `git status` clean) and said why
    path = repo / "model.pt"
    assert res.returncode != 0
    if path.exists():
        assert "model.pt is a placeholder (No space left on device); run `git theta checkout model.pt`" in err, err
        assert path.read_bytes().startswith(b"theta-metadata ") and repo.status() == ""
    else:
        assert "free" in err
    filler.unlink()
    repo.git("checkout", "--", "model.pt")  # the same command again completes the work
    got = torch.load(repo / "model.pt", weights_only=True)
    assert torch.equal(got["w"], sd["w"])
    assert leftovers(repo) == []


def test_kill_between_the_swap_and_the_index_update_leaves_the_whole_checkpoint(genv):
    """A materialized checkpoint takes its placeholder's place by an exchange of names; the writer killed
    right after it leaves the whole checkpoint under the real name (never a part of one), no lock, and no temp
    file (its watchdog removes the placeholder swapped out under its temp name). The index still
    holds the placeholder's stat data, whose size git takes as a change without reading the file (as after a
    kill between the former rename and the index update): `git add` finds the committed metadata again."""
    repo = genv.init("work")
    sd = make_state(3)
    save_pt(repo / "model.pt", sd)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = _v2(sd)
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    env = {"GIT_THETA_MATERIALIZE_ABOVE": "0"}  # the placeholder path for this small checkpoint
    res = limited_git(repo, "checkout", "-q", "HEAD~1", extra_env={**env, "GIT_THETA_FAULT": "materialize:swapped"})
    assert not (repo.git_common_dir() / "index.lock").exists(), res.err
    assert_same_checkpoint(repo / "model.pt", sd)
    index_blob = repo.out("ls-files", "-s", "model.pt")
    repo.git("add", "model.pt")
    assert repo.status() == "" and repo.out("ls-files", "-s", "model.pt") == index_blob
    theta_dir = repo.git_common_dir() / "theta"
    assert not any(theta_dir.glob("materialize-*"))  # the watchdog removed the killed writer's temp files
    repo.git("checkout", "-q", "main", extra_env=env)
    assert_same_checkpoint(repo / "model.pt", v2)
    assert not any(theta_dir.glob("materialize-*"))
    assert repo.status() == "" and leftovers(repo) == []
