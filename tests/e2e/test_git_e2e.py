"""theta end to end with the real git and git-lfs: add, commit, checkout, branches, stash, reset, formats, errors."""
import os
from collections import OrderedDict

import numpy as np
import pytest
import torch
import xxhash

from support.gitrepo import GitEnv
from support.checkpoints import assert_same_checkpoint, blob_oids, make_state, save_pt
from theta.storage.metadata import is_metadata, loads


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


@pytest.fixture
def repo(genv):
    return genv.init("work")


def test_history_checkout_branches_stash_reset(repo):
    v1 = make_state(0)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    text = repo.show("HEAD:model.pt")
    assert is_metadata(text) and len(text) < 20000
    objects_v1 = repo.lfs_objects()
    assert objects_v1 == blob_oids(repo, "HEAD:model.pt")

    v2 = OrderedDict(v1)
    v2["layers.1.attn.weight"] = v1["layers.1.attn.weight"] + 0.5
    v2["head.bias"] = torch.ones(64, dtype=torch.bfloat16)
    save_pt(repo / "model.pt", v2)
    assert repo.status() == "M model.pt"
    repo.commit("v2", "model.pt")
    new_objects = repo.lfs_objects() - objects_v1
    meta1, meta2 = loads(repo.show("HEAD~1:model.pt")), loads(repo.show("HEAD:model.pt"))
    changed = {n for n in meta2.groups if meta2.groups[n].hash != meta1.groups[n].hash}
    assert changed == {"model/layers.1.attn.weight", "model/head.bias"}
    # unchanged groups cost nothing: the new objects are only those of the two changed groups
    assert new_objects == {s.blob.oid for n in changed for s in meta2.groups[n].steps} - objects_v1

    repo.git("checkout", "-q", "HEAD~1")
    assert_same_checkpoint(repo / "model.pt", v1)
    assert repo.status() == ""
    repo.git("checkout", "-q", "main")
    assert_same_checkpoint(repo / "model.pt", v2)
    assert repo.status() == ""

    # a branch with its own change, switching back and forth
    repo.git("checkout", "-q", "-b", "exp")
    v3 = OrderedDict(v2)
    v3["embed.weight"] = v2["embed.weight"] * 2
    save_pt(repo / "model.pt", v3)
    repo.commit("v3 on exp", "model.pt")
    repo.git("checkout", "-q", "main")
    assert_same_checkpoint(repo / "model.pt", v2)
    repo.git("checkout", "-q", "exp")
    assert_same_checkpoint(repo / "model.pt", v3)

    # stash and reset --hard restore through the smudge filter
    save_pt(repo / "model.pt", v1)
    repo.git("stash", "-q")
    assert_same_checkpoint(repo / "model.pt", v3)
    assert repo.status() == ""
    repo.git("stash", "pop", "-q")
    assert_same_checkpoint(repo / "model.pt", v1)
    repo.git("reset", "-q", "--hard")
    assert_same_checkpoint(repo / "model.pt", v3)
    assert repo.status() == ""


def test_clean_is_deterministic_and_spool_path_matches_worktree_path(repo):
    save_pt(repo / "model.pt", make_state(2))
    via_add = repo.git("hash-object", "--path=model.pt", "model.pt").stdout
    spooled = repo.git("hash-object", "--path=model.pt", "model.pt", extra_env={"GIT_THETA_SPOOL": "always"}).stdout
    data = (repo / "model.pt").read_bytes()
    via_stdin = repo.git("hash-object", "--stdin", "--path=model.pt", input=data).stdout
    assert via_add == spooled == via_stdin


def test_clean_overlaps_git_stream_only_when_it_is_the_worktree_file(repo, tmp_path):
    """The filter starts cleaning the work-tree file while git's bytes arrive; when they turn out to be other
    bytes (`hash-object --stdin --path`), that clean is dropped and git's bytes are cleaned instead."""
    save_pt(repo / "model.pt", make_state(2))
    repo.commit("v1", ".gitattributes", "model.pt")
    timing = {"GIT_THETA_TIMING": "1"}
    save_pt(repo / "model.pt", make_state(6))  # the work tree holds v2...
    save_pt(tmp_path / "other.pt", make_state(7))
    other = (tmp_path / "other.pt").read_bytes()
    # ...git sends v3 for the same path: the early clean of v2 is dropped
    p = repo.git("hash-object", "-w", "--stdin", "--path=model.pt", input=other, extra_env=timing)
    via_stdin = p.stdout.decode().strip()
    assert "spooled" in p.stderr.decode() and "while git sent it" not in p.stderr.decode()
    (repo / "model.pt").write_bytes(other)
    p = repo.git("hash-object", "--path=model.pt", "model.pt", extra_env=timing)
    assert "while git sent it" in p.stderr.decode(), p.stderr.decode()
    assert p.stdout.decode().strip() == via_stdin
    text = repo.git("cat-file", "blob", via_stdin).stdout
    embed = loads(text).groups["model/embed.weight"]  # v3's values, not the work tree's v2
    assert embed.fast == xxhash.xxh3_128_hexdigest(make_state(7)["embed.weight"].numpy().tobytes())


def test_metadata_passes_through_clean_unchanged(repo):
    save_pt(repo / "model.pt", make_state(3))
    repo.commit("v1", ".gitattributes", "model.pt")
    text = repo.show("HEAD:model.pt")
    again = repo.git("hash-object", "--stdin", "--path=model.pt", input=text).stdout.decode().strip()
    assert again == repo.out("rev-parse", "HEAD:model.pt")


# a damaged checkpoint is refused; a file that is no checkpoint at all (empty, zeros, text) is stored as one
# opaque blob instead (tests/hostile/test_opaque_files.py)
@pytest.mark.parametrize("content", [b"PK\x03\x04 this is no zip at all" * 10, "truncated"])
def test_corrupt_checkpoint_is_refused_and_index_untouched(repo, content):
    save_pt(repo / "model.pt", make_state(4))
    repo.commit("v1", ".gitattributes", "model.pt")
    index = (repo.git_common_dir() / "index").read_bytes()
    if content == "truncated":
        content = (repo / "model.pt").read_bytes()[:-100]
    (repo / "model.pt").write_bytes(content)
    proc = repo.git("add", "model.pt", check=False)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "model.pt" in err and "git-theta: error: clean model.pt" in err
    assert (repo.git_common_dir() / "index").read_bytes() == index
    assert repo.out("diff", "--cached", "--name-only") == ""


def test_unsafe_pickle_is_refused(repo, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"w": torch.zeros(3), "evil": Evil()}, repo / "model.pt")
    proc = repo.git("add", "model.pt", check=False)
    assert proc.returncode != 0 and b"git-theta: error" in proc.stderr
    assert repo.out("ls-files", "--stage") == ""


def test_safetensors_round_trip_and_metadata(repo):
    from safetensors.numpy import load_file, save_file

    arrays = {"w": np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32),
              "b": np.arange(30, dtype=np.int32)}
    save_file(arrays, str(repo / "m.safetensors"), metadata={"format": "pt", "note": "hi"})
    repo.commit("st", ".gitattributes", "m.safetensors")
    assert loads(repo.show("HEAD:m.safetensors")).format == "safetensors"
    os.unlink(repo / "m.safetensors")
    repo.git("checkout", "--", "m.safetensors")
    got = load_file(str(repo / "m.safetensors"))
    assert set(got) == set(arrays) and all(np.array_equal(got[k], arrays[k]) for k in arrays)
    from safetensors import safe_open
    with safe_open(str(repo / "m.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt", "note": "hi"}
    assert repo.status() == ""


def test_hdf5_round_trip(repo):
    import h5py

    w = np.random.default_rng(1).standard_normal((20, 10)).astype(np.float32)
    with h5py.File(repo / "m.h5", "w") as f:
        f["dense/kernel"] = w
        f["dense/bias"] = np.arange(10, dtype=np.float64)
    repo.commit("h5", ".gitattributes", "m.h5")
    os.unlink(repo / "m.h5")
    repo.git("checkout", "--", "m.h5")
    with h5py.File(repo / "m.h5", "r") as f:
        assert np.array_equal(f["dense/kernel"][()], w)
        assert np.array_equal(f["dense/bias"][()], np.arange(10, dtype=np.float64))


def test_checkout_format_attribute_and_export(repo):
    from safetensors.torch import load_file

    sd = make_state(5)
    save_pt(repo / "model.pt", sd)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(sd)
    v2["embed.weight"] = sd["embed.weight"] + 1
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")

    # export any committed version, in any format, without touching the working tree
    before = (repo / "model.pt").read_bytes()
    repo.theta("export", "HEAD~1:model.pt", str(repo.path.parent / "v1.safetensors"), "--to", "safetensors")
    got = load_file(str(repo.path.parent / "v1.safetensors"))
    assert torch.equal(got["model/embed.weight"], sd["embed.weight"])
    repo.theta("export", "HEAD~1:model.pt", str(repo.path.parent / "v1.pt"))
    assert_same_checkpoint(repo.path.parent / "v1.pt", sd)
    assert (repo / "model.pt").read_bytes() == before and repo.status() == ""

    # the theta-format attribute makes checkout write safetensors whatever was committed
    with open(repo / ".git" / "info" / "attributes", "w") as f:
        f.write("model.pt theta-format=safetensors\n")
    os.unlink(repo / "model.pt")
    repo.git("checkout", "--", "model.pt")
    got = load_file(str(repo / "model.pt"))
    assert torch.equal(got["model/embed.weight"], v2["embed.weight"])
    # and so does git config theta.checkoutFormat (the attribute wins when both are set)
    os.unlink(repo.path / ".git" / "info" / "attributes")
    repo.git("config", "theta.checkoutFormat", "safetensors")
    os.unlink(repo / "model.pt")
    repo.git("checkout", "--", "model.pt")
    assert torch.equal(load_file(str(repo / "model.pt"))["model/head.bias"], v2["head.bias"])


def test_ls_files_and_theta_add_options(repo):
    sd = make_state(6)
    save_pt(repo / "model.pt", sd)
    repo.theta("add", "model.pt", "--option", "level=1")
    repo.git("add", ".gitattributes")
    out = repo.theta("ls-files").stdout.decode()
    line = [ln for ln in out.splitlines() if ln.endswith("  model.pt")][0]  # the path last, never cut
    fields = line.split()
    assert fields[0] == "torch" and fields[1] == str(len(sd)) and fields[-2:] == ["yes", "model.pt"]
    save_pt(repo / "model.pt", make_state(7))  # new content, so git runs the filter again
    proc = repo.theta("add", "model.pt", "--option", "level=notanumber", check=False)
    assert proc.returncode != 0 and b"GIT_THETA_LEVEL" in proc.stderr


def test_single_file_filter_fallbacks(repo):
    """Without filter.theta.process git runs `git-theta clean %f` / `git-theta smudge %f` per file."""
    repo.git("config", "--local", "--unset", "filter.theta.process")
    sd = make_state(8)
    save_pt(repo / "model.pt", sd)
    repo.commit("v1", ".gitattributes", "model.pt")
    assert is_metadata(repo.show("HEAD:model.pt"))
    os.unlink(repo / "model.pt")
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", sd)
    assert repo.status() == ""
    (repo / "model.pt").write_bytes(b"not a checkpoint")  # not one at all: one opaque blob, with a warning
    proc = repo.git("add", "model.pt")
    assert b"stored as one opaque blob" in proc.stderr
    (repo / "model.pt").write_bytes(b"PK\x03\x04 a damaged zip" * 10)  # a damaged checkpoint: refused
    proc = repo.git("add", "model.pt", check=False)
    assert proc.returncode != 0 and b"error: " in proc.stderr
