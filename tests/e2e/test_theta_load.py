"""`theta.load(path, rev=...)`, zipslice on placeholders and on REV:PATH: any committed version read lazily
from the blob store, never written to disk, with zipslice.load's API and values bit for bit."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import theta
import zipslice
from zipslice import formats
from zipslice.errors import NotACheckpointError, ZipsliceError
from support.checkpoints import blob_oids, make_state, save_pt
from support.gitrepo import GitEnv, Repo
from support.plugins import declared_site
from theta.model.zipslice_format import FORMAT


@pytest.fixture
def theta_plugin(monkeypatch):
    """theta's zipslice format registered (as pip install registers the entry point in pyproject.toml)."""
    monkeypatch.setitem(formats.registry(), "theta", FORMAT)


@pytest.fixture
def genv(tmp_path):
    env = GitEnv.create(tmp_path)
    env.run(["git", "theta", "install"], cwd=env.home)
    return env


def two_versions(repo: Repo):
    v1 = make_state(5)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v1)
    del v2["embed.weight"]
    v2["layers.0.mlp.weight"] = v1["layers.0.mlp.weight"] + 3
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    return v1, v2


def assert_same_lazy(got, want) -> None:
    """Same names, infos, values (bit for bit), extras, structure and metadata as zipslice reads them."""
    assert list(got) == list(want)
    for k in want:
        a, b = got.info(k), want.info(k)
        assert (a.dtype, a.shape, a.is_parameter, a.requires_grad) == (b.dtype, b.shape, b.is_parameter, b.requires_grad)
        assert bytes(got.read_bytes(k)) == bytes(want.read_bytes(k)), k
        ta, tb = got[k], want[k]
        assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8) if ta.dim() else ta,
                                                    tb.view(torch.uint8) if tb.dim() else tb), k
    assert got.extras == want.extras
    assert got.structure == want.structure
    assert got.metadata == want.metadata
    assert got.format == want.format


def test_load_a_committed_version_without_writing_it(genv, tmp_path):
    repo = genv.init("work")
    v1, v2 = two_versions(repo)
    old = tmp_path / "v1" / "model.pt"
    old.parent.mkdir()
    repo.theta("export", "HEAD~1:model.pt", str(old))
    before = sorted(p.name for p in repo.path.iterdir())
    with theta.load(repo / "model.pt", rev="HEAD~1") as lsd, zipslice.load(old) as want:
        assert isinstance(lsd, zipslice.LazyCheckpoint)
        assert "model/embed.weight" in lsd
        assert_same_lazy(lsd, want)
        assert repr(lsd).startswith("<ThetaCheckpoint 'HEAD~1:model.pt' rev='HEAD~1'")
    assert sorted(p.name for p in repo.path.iterdir()) == before
    # rev=None is the work-tree file itself; ":" is the index
    with theta.load(repo / "model.pt") as lsd:
        assert type(lsd).__name__ == "TorchCheckpoint" and "model/embed.weight" not in lsd
    with theta.load(repo / "model.pt", rev=":") as lsd:
        assert "model/embed.weight" not in lsd and len(lsd) == len(zipslice.load(repo / "model.pt"))
    with pytest.raises(theta.base.errors.ThetaError, match="HEAD~1:nope.pt: no such file in git"):
        theta.load(repo / "nope.pt", rev="HEAD~1")


def test_safetensors_version(genv, tmp_path):
    repo = genv.init("work")
    arrays = {"b": np.arange(6, dtype="<f4").reshape(2, 3), "a": np.ones(5, dtype="<i8")}
    save_file(arrays, repo / "w.safetensors", metadata={"note": "v1"})
    repo.commit("v1", ".gitattributes", "w.safetensors")
    keep = tmp_path / "w.safetensors"
    shutil.copy(repo / "w.safetensors", keep)
    save_file({"b": np.zeros((2, 3), dtype="<f4")}, repo / "w.safetensors")
    repo.commit("v2", "w.safetensors")
    with theta.load(repo / "w.safetensors", rev="HEAD~1") as lsd, zipslice.load(keep) as want:
        assert_same_lazy(lsd, want)
        assert lsd.metadata == {"note": "v1"}


def test_missing_blobs_are_fetched_group_by_group(genv):
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    v1, v2 = two_versions(repo)
    repo.git("push", "-q", "origin", "main")
    clone = genv.clone(f"file://{bare.path}", "clone")
    local = clone.lfs_objects()
    assert local == blob_oids(clone, "HEAD:model.pt")
    with theta.load(clone / "model.pt", rev="HEAD~1") as lsd:
        assert len(clone.lfs_objects()) == len(local)        # opening reads the metadata only
        w = lsd["model/embed.weight"]                         # the one group v2 does not have
        assert torch.equal(w, v1["embed.weight"])
        group = lsd.meta.groups["model/embed.weight"]
        assert clone.lfs_objects() == local | {s.blob.oid for s in group.steps}
        still = blob_oids(clone, "HEAD~1:model.pt") - clone.lfs_objects()
        assert still and lsd.fetch() == len(still)
        assert blob_oids(clone, "HEAD~1:model.pt") <= clone.lfs_objects()
    with theta.load(clone / "model.pt", rev="HEAD~1", fetch=False) as lsd:
        assert torch.equal(lsd["model/layers.0.mlp.weight"], v1["layers.0.mlp.weight"])


def test_zipslice_reads_a_placeholder_in_place(genv, tmp_path, theta_plugin):
    repo = genv.init("work")
    v1, v2 = two_versions(repo)
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt", extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    placeholder = repo / "model.pt"
    assert placeholder.read_bytes() == repo.show("HEAD:model.pt")
    ref = tmp_path / "ref" / "model.pt"
    ref.parent.mkdir()
    repo.theta("export", "HEAD:model.pt", str(ref))
    with zipslice.load(placeholder) as lsd, zipslice.load(ref) as want:
        assert type(lsd).__name__ == "ThetaCheckpoint"
        assert_same_lazy(lsd, want)
    with theta.load(placeholder) as lsd:
        assert type(lsd).__name__ == "ThetaCheckpoint" and len(lsd) == len(v2)

    # outside any repository: says what the file is and what to run
    stray = tmp_path / "elsewhere" / "model.pt"
    stray.parent.mkdir()
    shutil.copy(placeholder, stray)
    with pytest.raises(NotACheckpointError, match="git-theta placeholder.*`git theta pull`"):
        zipslice.load(stray)
    # a reading error names the file and the group
    store = repo.git_common_dir() / "lfs" / "objects"
    shutil.rmtree(store)
    shutil.rmtree(repo.git_common_dir() / "lfs" / "theta-objects")  # theta's protected second name (care)
    with zipslice.load(placeholder) as lsd:
        with pytest.raises(ZipsliceError, match=r"model.pt \[model/head.bias\]: .*blob"):
            lsd["model/head.bias"]


def test_zipslice_without_the_theta_plugin_names_the_placeholder(tmp_path, monkeypatch):
    p = tmp_path / "model.pt"
    p.write_bytes(b'theta-metadata 1\n{"checkpoint":{"format":"torch"}}\n')
    monkeypatch.delitem(formats.registry(), "theta", raising=False)
    with pytest.raises(NotACheckpointError, match="git-theta placeholder.*git theta checkout"):
        zipslice.load(p)


def test_zipslice_cli_reads_rev_path(genv, tmp_path):
    repo = genv.init("work")
    v1, v2 = two_versions(repo)
    env = {**genv.env, "PYTHONPATH": os.pathsep.join([str(declared_site(tmp_path)), genv.env["PYTHONPATH"]])}

    def zs(*args, check=True):
        return subprocess.run([sys.executable, "-m", "zipslice.cli", *args], cwd=repo.path, env=env,
                              capture_output=True, text=True, check=check)

    import json

    listing = json.loads(zs("ls", "--json", "HEAD~1:model.pt").stdout)
    names = [t["name"] for t in listing["tensors"]]
    assert "model/embed.weight" in names and listing["format"] == "torch"
    diff = zs("diff", "--json", "HEAD~1:model.pt", "model.pt", check=False)
    assert diff.returncode == 1
    report = json.loads(diff.stdout)
    status = {t["name"]: t["status"] for t in report["tensors"]}
    assert status["model/embed.weight"] == "removed" and status["model/layers.0.mlp.weight"] == "changed"
    assert status["model/layers.1.mlp.weight"] == "same"
    missing = zs("ls", "HEAD~1:nope.pt", check=False)
    assert missing.returncode != 0 and "nope.pt" in missing.stderr
