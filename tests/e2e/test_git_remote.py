"""Push and clone through real remotes: a file:// bare repository (git-lfs's standalone file transfer) and a
giftless LFS HTTP server. Push uploads exactly the blobs the pushed commits reference and the remote lacks;
clone downloads only the blobs of the checked-out version."""
from collections import OrderedDict

import pytest
from scripts.bench.lfs_server import GiftlessServer
from support.checkpoints import assert_same_checkpoint, blob_oids, make_state, save_pt
from support.gitrepo import GitEnv, bare_lfs_objects


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def _history(repo):
    """Two commits of model.pt; returns (v1, v2) state dicts."""
    v1 = make_state(10)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v1)
    v2["layers.0.mlp.weight"] = v1["layers.0.mlp.weight"] * 1.5
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    return v1, v2


def _remote_roundtrip(genv, repo, remote_objects, full=True):
    v1, v2 = _history(repo)
    repo.git("push", "-q", "origin", "main")
    expected = blob_oids(repo, "HEAD~1:model.pt") | blob_oids(repo, "HEAD:model.pt")
    assert remote_objects() == expected  # exactly the referenced blobs
    if not full:
        clone = genv.clone(repo.git("remote", "get-url", "origin").stdout.decode().strip(), "clone")
        assert_same_checkpoint(clone / "model.pt", v2)
        assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt")
        return clone

    # a further commit uploads only its own new blobs
    v3 = OrderedDict(v2)
    v3["embed.weight"] = v2["embed.weight"] - 1
    save_pt(repo / "model.pt", v3)
    repo.commit("v3", "model.pt")
    new = blob_oids(repo, "HEAD:model.pt") - expected
    assert len(new) == 1
    repo.git("push", "-q", "origin", "main")
    assert remote_objects() == expected | new

    # clone: only the blobs of the checked-out version come down
    clone = genv.clone(repo.git("remote", "get-url", "origin").stdout.decode().strip(), "clone")
    assert_same_checkpoint(clone / "model.pt", v3)
    assert clone.status() == ""
    assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt")
    # an older version is fetched on checkout (one git-lfs run for the file)
    clone.git("checkout", "-q", "HEAD~2")
    assert_same_checkpoint(clone / "model.pt", v1)
    assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt") | blob_oids(clone, "main:model.pt")
    # the clone's filter installed theta's pre-push hook by itself
    assert "git-theta pre-push" in (clone.git_common_dir() / "hooks" / "pre-push").read_text()
    return clone


def test_file_remote_push_and_clone(genv):
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    genv.run(["git", "theta", "install"], cwd=genv.home)  # global drivers, so the clone's checkout runs theta
    _remote_roundtrip(genv, repo, lambda: bare_lfs_objects(bare.path))


@pytest.mark.lfs_server
def test_giftless_remote_push_and_clone(genv, tmp_path):
    with GiftlessServer(tmp_path / "lfs-store") as server:
        url = server.lfs_url("org", "model")
        repo = genv.init("work")
        bare = genv.init("remote.git", theta=False, bare=True)
        repo.git("remote", "add", "origin", str(bare.path))
        repo.git("config", "lfs.url", url)
        genv.run(["git", "theta", "install"], cwd=genv.home)
        # the clone must know the LFS server before its checkout runs: global lfs.url for this test's HOME
        genv.run(["git", "config", "--global", "lfs.url", url], cwd=genv.home)
        _remote_roundtrip(genv, repo, server.objects, full=False)  # the full round trip runs over file://
        assert not bare_lfs_objects(bare.path)  # nothing went to the git remote itself


def test_missing_blob_fails_checkout_cleanly(genv):
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    _history(repo)
    # push the commits but bypass theta's hook: the remote lacks the blobs
    repo.git("push", "-q", "--no-verify", "origin", "main")
    genv.run(["git", "theta", "install"], cwd=genv.home)
    proc = genv.run(["git", "clone", f"file://{bare.path}", str(genv.home.parent / "clone")], cwd=genv.home,
                    check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert "model.pt" in err and "could not download" in err and "group 'model/" in err and "needs blob" in err


def test_clone_fetches_all_files_in_one_git_lfs_run(genv):
    """git's delay capability: every smudge of the checkout is set aside, then one git-lfs run fetches all."""
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    states = {}
    for i, name in enumerate(("a.pt", "b.pt", "sub/c.pt")):
        (repo / name).parent.mkdir(exist_ok=True)
        states[name] = make_state(20 + i, n_layers=1)
        save_pt(repo / name, states[name])
    repo.commit("three models", ".gitattributes", "a.pt", "b.pt", "sub/c.pt")
    repo.git("push", "-q", "origin", "main")
    genv.run(["git", "theta", "install"], cwd=genv.home)
    proc = genv.run(["git", "clone", f"file://{bare.path}", str(genv.home.parent / "clone")], cwd=genv.home,
                    extra_env={"GIT_THETA_TIMING": "1"})
    err = proc.stderr.decode()
    assert "for 3 file(s) in one git-lfs run" in err, err
    clone_path = genv.home.parent / "clone"
    for name, sd in states.items():
        assert_same_checkpoint(clone_path / name, sd)
