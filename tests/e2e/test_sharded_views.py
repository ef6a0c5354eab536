"""Sharded checkpoints and views, with real git, git-lfs and each format's own library.

- A sharded checkpoint committed as shard files + index: each shard is a view in any other format, git status
  stays clean, an edit in one shard commits that shard only, in its committed format.
- One committed file as shards: git cannot check one path out as several files, so `git theta export
  REV:PATH NAME.safetensors.index.json` writes the shards (read by huggingface_hub's own sharded loader), and
  `git theta add --from NAME.safetensors.index.json PATH` records edited shards back into PATH, in PATH's
  committed format, structure and metadata; refusals name the group and stage nothing.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
import torch

from support import formats
from support.formats import same_bits
from support.gitrepo import GitEnv
from theta.storage.metadata import loads

SHARD_EXT = {"safetensors": ".safetensors", "torch": ".bin", "hdf5": ".h5"}
# one view of each committed shard format by default (safetensors shards as torch: test_format_views.py)
FAST = {("safetensors", "hdf5"), ("torch", "safetensors"), ("hdf5", "torch")}
SHARDED_PAIRS = [pytest.param(c, v, marks=() if (c, v) in FAST else pytest.mark.slow)
                 for c in formats.FORMATS for v in formats.FORMATS if c != v]


@pytest.fixture
def repo(tmp_path):
    return GitEnv.create(tmp_path).init("work", track=("*.pt", "*.safetensors", "*.h5", "*.bin"))


def layers(n: int = 6, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(n)}


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a)


def check_out_again(repo, *names: str) -> None:
    for name in names:
        os.unlink(repo / name)
    repo.git("checkout", "--", *names)


def index_and_stats(repo) -> str:
    return repo.out("ls-files", "-s")


# -- a committed sharded checkpoint: each shard is a view --------------------------------------------------

@pytest.mark.parametrize("committed,view", SHARDED_PAIRS)
def test_committed_shards_viewed_in_another_format(repo, committed, view):
    import zipslice
    from zipslice import sharded
    from zipslice.sources import as_sources

    tensors = layers()
    index = f"model{SHARD_EXT[committed]}.index.json"
    sharded.write(repo / index, as_sources(tensors.items()), max_shard_bytes=3 * 32 * 32 * 4)
    shards = sorted(json.loads((repo / index).read_text())["weight_map"].values())
    shards = sorted(set(shards))
    assert len(shards) == 2
    repo.commit("sharded", ".gitattributes", index, *shards)
    first = {s: repo.show(f"HEAD:{s}") for s in shards}

    (repo / ".git" / "info" / "attributes").write_text("".join(f"{s} theta-format={view}\n" for s in shards))
    check_out_again(repo, *shards)
    per_shard = {}
    for s in shards:
        assert formats.sniff(repo / s) == view
        per_shard.update(formats.read(repo / s, view))  # the view format's own library, shard by shard
    assert same(per_shard, tensors)
    with zipslice.load(repo / index) as lsd:  # the index still names every tensor's (viewed) shard
        assert same({k: lsd[k] for k in lsd}, tensors)
    assert repo.status() == "" and repo.out("diff") == ""
    before = index_and_stats(repo)
    repo.git("add", "--renormalize", ".")
    assert index_and_stats(repo) == before

    edited = "layers.5.weight"
    formats.edit(repo / shards[1], edited, torch.zeros(32, 32), view)
    assert repo.status() == f"M {shards[1]}"
    repo.git("commit", "-qam", "edit one tensor of shard 2 in the view")
    assert repo.out("diff", "--name-only", "HEAD~1", "HEAD") == shards[1]
    assert repo.show(f"HEAD:{shards[0]}") == first[shards[0]]
    old, new = loads(first[shards[1]]), loads(repo.show(f"HEAD:{shards[1]}"))
    assert (new.format, new.order, new.metadata) == (old.format, old.order, old.metadata) and new.format == committed
    assert {n for n in new.groups if new.groups[n] != old.groups[n]} == {edited}

    os.unlink(repo / ".git" / "info" / "attributes")
    check_out_again(repo, *shards)
    back = {}
    for s in shards:
        assert formats.sniff(repo / s) == committed
        back.update(formats.read(repo / s, committed))
    assert same(back, {**tensors, edited: torch.zeros(32, 32)})
    assert repo.status() == ""


def test_shard_index_under_a_catch_all_pattern_stays_json(tmp_path):
    """`git theta track '*'` catches model.safetensors.index.json too: it stays the JSON text it is (its shards are
    tracked on their own), checks out bit for bit, and a view of the shards still loads through it."""
    import zipslice
    from zipslice import sharded
    from zipslice.sources import as_sources

    repo = GitEnv.create(tmp_path).init("work", track=("*",))
    tensors = layers(4)
    index = "model.safetensors.index.json"
    sharded.write(repo / index, as_sources(tensors.items()), max_shard_bytes=2 * 32 * 32 * 4)
    text = (repo / index).read_bytes()
    repo.git("add", "-A")
    repo.git("commit", "-qm", "sharded, everything through theta")
    assert repo.show(f"HEAD:{index}") == text
    shards = sorted(set(json.loads(text)["weight_map"].values()))
    assert all(loads(repo.show(f"HEAD:{s}")).format == "safetensors" for s in shards)
    repo.git("config", "theta.checkoutFormat", "torch")
    check_out_again(repo, index, *shards)
    assert (repo / index).read_bytes() == text and repo.status() == ""
    with zipslice.load(repo / index) as lsd:
        assert same({k: lsd[k] for k in lsd}, tensors)


# -- one committed file, written as shards and recorded back ----------------------------------------------

class Layers(torch.nn.Module):
    """A module whose state dict is layers() (what huggingface_hub loads a sharded checkpoint into)."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(n))


@pytest.mark.parametrize("worktree", ["safetensors", "torch"])
def test_single_file_exported_as_shards_and_recorded_back(repo, tmp_path, worktree):
    """model.safetensors committed as one file, worked on as safetensors shards; the work tree holds either
    the committed format or a torch view of it."""
    hub = pytest.importorskip("huggingface_hub")
    import safetensors.torch

    tensors = layers()
    tensors["norm.bias"] = torch.arange(32, dtype=torch.bfloat16)
    safetensors.torch.save_file(tensors, str(repo / "model.safetensors"), metadata={"format": "pt"})
    repo.commit("v1", ".gitattributes", "model.safetensors")
    first_text = repo.show("HEAD:model.safetensors")
    first = loads(first_text)
    if worktree == "torch":
        (repo / ".git" / "info" / "attributes").write_text("model.safetensors theta-format=torch\n")
        check_out_again(repo, "model.safetensors")

    out = tmp_path / "shards"
    out.mkdir()
    index = out / "model.safetensors.index.json"
    proc = repo.theta("export", "HEAD:model.safetensors", str(index), "--max-shard-size", "9KiB")
    assert b"safetensors shards" in proc.stderr
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]  # 2 x 4 KiB + the bias
    assert sorted(p.name for p in out.iterdir()) == sorted(shards + [index.name])  # no temp file left
    read_back = {}
    for s in shards:
        part = safetensors.torch.load_file(str(out / s))
        assert all(weight_map[k] == s for k in part) and os.path.getsize(out / s) < 9 * 1024 + 1024
        assert formats.file_metadata(out / s, "safetensors") == {"format": "pt"}
        read_back.update(part)
    assert same(read_back, tensors)
    model = Layers()
    hub.load_torch_model(model, out, strict=False)  # huggingface_hub's own sharded-safetensors loader
    for i in range(6):
        assert same_bits(model.layers[i].weight.detach(), tensors[f"layers.{i}.weight"])

    # edit one tensor in its shard with the safetensors library, then record the shards as model.safetensors
    edited = "layers.4.weight"
    formats.edit(out / weight_map[edited], edited, tensors[edited] * 3, "safetensors")
    proc = repo.theta("add", "--from", str(index), "model.safetensors")
    assert b"1 changed group" in proc.stdout, proc
    staged = loads(repo.show(":model.safetensors"))
    assert (staged.format, staged.order, staged.metadata) == (first.format, first.order, first.metadata)
    assert {n for n in staged.groups if staged.groups[n] != first.groups[n]} == {edited}
    assert repo.status() == "M  model.safetensors"  # staged; the work tree agrees with the index
    assert formats.sniff(repo / "model.safetensors") == worktree
    assert same(formats.read(repo / "model.safetensors", worktree), {**tensors, edited: tensors[edited] * 3})
    assert os.stat(repo / "model.safetensors").st_mode & 0o777 == 0o644 & ~_umask()
    repo.git("commit", "-qm", "edit from the shards")
    assert repo.status() == ""

    # unchanged shards recorded again: nothing to stage
    before = index_and_stats(repo)
    repo.theta("add", "--from", str(index), "model.safetensors")
    assert index_and_stats(repo) == before and repo.status() == ""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_torch_file_as_torch_shards_keeps_its_structure(repo, tmp_path):
    """A nested torch checkpoint (non-tensor values, ties) exported as flat torch shards and recorded back: the
    committed structure, `epoch` and the tie are kept; only the edited group changes."""
    g = torch.Generator().manual_seed(9)
    sd = OrderedDict()
    sd["embed.weight"] = torch.randn(16, 8, generator=g)
    sd["layer.weight"] = torch.randn(8, 8, generator=g)
    sd["head.weight"] = sd["embed.weight"]
    torch.save({"model": sd, "epoch": 3}, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    first = loads(repo.show("HEAD:model.pt"))
    index = tmp_path / "pytorch_model.bin.index.json"
    repo.theta("export", "HEAD:model.pt", str(index), "--max-shard-size", "600")
    weight_map = json.loads(index.read_text())["weight_map"]
    assert sorted(weight_map) == ["model/embed.weight", "model/head.weight", "model/layer.weight"]
    # the tie stays in one shard, which torch loads with one shared storage
    tied = formats.torch_load(tmp_path / weight_map["model/embed.weight"])
    assert tied["model/head.weight"].untyped_storage().data_ptr() == tied["model/embed.weight"].untyped_storage().data_ptr()
    shard = tmp_path / weight_map["model/layer.weight"]
    part = formats.torch_load(shard)
    part["model/layer.weight"] = part["model/layer.weight"] + 1
    torch.save(part, shard)

    repo.theta("add", "--from", str(index), "model.pt")
    staged = loads(repo.show(":model.pt"))
    assert (staged.structure, staged.aliases, staged.order) == (first.structure, first.aliases, first.order)
    assert {n for n in staged.groups if staged.groups[n] != first.groups[n]} == {"model/layer.weight"}
    obj = formats.torch_load(repo / "model.pt")
    assert obj["epoch"] == 3 and torch.equal(obj["model"]["layer.weight"], sd["layer.weight"] + 1)
    assert obj["model"]["head.weight"].untyped_storage().data_ptr() == obj["model"]["embed.weight"].untyped_storage().data_ptr()
    assert repo.status() == "M  model.pt"


def test_refusals_leave_nothing(repo, tmp_path):
    import safetensors.torch

    safetensors.torch.save_file(layers(), str(repo / "model.safetensors"))
    torch.save({"c": torch.zeros(4, dtype=torch.complex128), "w": torch.ones(3)}, repo / "c.pt")
    repo.commit("v1", ".gitattributes", "model.safetensors", "c.pt")

    # export: a group the shard format cannot hold, refused before anything is written
    out = tmp_path / "out"
    out.mkdir()
    proc = repo.theta("export", "HEAD:c.pt", str(out / "c.safetensors.index.json"), check=False)
    assert proc.returncode != 0 and b"'c'" in proc.stderr and b"complex128" in proc.stderr, proc.stderr
    assert list(out.iterdir()) == []
    proc = repo.theta("export", "HEAD:c.pt", str(out / "c.txt.index.json"), check=False)
    assert proc.returncode != 0 and b"shard format" in proc.stderr and list(out.iterdir()) == []
    proc = repo.theta("export", "--to", "torch", "HEAD:c.pt", str(out / "c.safetensors.index.json"), check=False)
    assert proc.returncode != 0 and b"not torch" in proc.stderr

    # add --from: a dtype the committed format lacks, named, nothing staged, work tree untouched
    index = out / "model.safetensors.index.json"
    repo.theta("export", "HEAD:model.safetensors", str(index), "--max-shard-size", "9KiB")
    shard = out / json.loads(index.read_text())["weight_map"]["layers.2.weight"]
    with open(shard, "rb") as f:
        keep = f.read()
    part = {k: v.clone() for k, v in safetensors.torch.load_file(str(shard)).items()}  # not mapped: rewritten
    part["layers.2.weight"] = torch.zeros(2, dtype=torch.complex128)
    torch.save(part, shard)  # a torch shard now: zipslice reads every shard by its bytes
    git_index = (repo.git_common_dir() / "index").read_bytes()
    worktree = (repo / "model.safetensors").read_bytes()
    proc = repo.theta("add", "--from", str(index), "model.safetensors", check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0 and "'layers.2.weight'" in err and "complex128" in err and "nothing" in err, err
    assert (repo.git_common_dir() / "index").read_bytes() == git_index
    assert (repo / "model.safetensors").read_bytes() == worktree and repo.status() == ""
    shard.write_bytes(keep)

    # a path theta does not track, several paths, a sharded source for a new file without --format
    (repo / "notes.txt").write_text("x")
    for args, words in ((["notes.txt"], "not tracked by theta"),
                        (["model.safetensors", "c.pt"], "one PATH"),
                        (["new.safetensors"], "--format")):
        proc = repo.theta("add", "--from", str(index), *args, check=False)
        assert proc.returncode != 0 and words in proc.stderr.decode(), (args, proc.stderr)
    assert repo.status() == "?? notes.txt"

    # with --format: a new file from shards, recorded in the format asked for
    repo.theta("add", "--from", str(index), "--format", "torch", "new.safetensors")
    assert loads(repo.show(":new.safetensors")).format == "torch"
    assert same(formats.read(repo / "new.safetensors", "torch"), layers())
