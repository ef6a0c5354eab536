"""Update types through the real git, git-lfs and theta filter: commit a base and an update, check out each
commit and compare with what was saved, `git status` clean after every checkout; rebase, squash, bounded
chains, a single-branch clone, and bad side-loaded files that must stage nothing."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file

from support.gitrepo import GitEnv, bare_lfs_objects
from theta.storage.metadata import loads

W = "layers.0.attn.weight"     # the group the updates touch (key inside the torch file's "model" dict)
G = "model/" + W               # its theta group name


def make_state(seed: int = 0) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    sd["embed.weight"] = torch.randn(128, 48, generator=g)
    for i in range(2):
        sd[f"layers.{i}.attn.weight"] = torch.randn(96, 48, generator=g) * 0.02
        sd[f"layers.{i}.mlp.weight"] = (torch.randn(96, 48, generator=g) * 0.02).to(torch.bfloat16)
    sd["head.bias"] = torch.zeros(128)
    return sd


def save_pt(path, sd) -> None:
    torch.save({"model": sd, "epoch": 1}, path)


def load_pt(path) -> OrderedDict:
    return torch.load(path, weights_only=True)["model"]


def assert_bits(got: OrderedDict, want: OrderedDict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def steps(repo, rev: str = "HEAD") -> list[str]:
    return [s.type for s in loads(repo.show(f"{rev}:model.pt")).groups[G].steps]


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


@pytest.fixture
def repo(genv):
    r = genv.init("work")
    save_pt(r / "model.pt", make_state(0))
    r.commit("base", ".gitattributes", "model.pt")
    return r


def lora(sd: OrderedDict, rank: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(sd[W].shape[0], rank, generator=g) * 0.05
    C = torch.randn(rank, sd[W].shape[1], generator=g) * 0.05
    return R, C


def sparse_update(sd: OrderedDict):
    """Git-Theta's layout: a CSR of the flattened update (1 x N)."""
    idx = torch.tensor([1, 7, 100, 2000, 4000], dtype=torch.int64)
    data = torch.tensor([0.5, -0.25, 0.125, 1.0, -2.0])
    return {f"{G}/data": data, f"{G}/indices": idx.to(torch.int32), f"{G}/indptr": torch.tensor([0, 5]),
            f"{G}/shape": torch.tensor(list(sd[W].shape))}, idx, data


def test_side_loaded_low_rank_sparse_ia3(repo, tmp_path):
    v0 = load_pt(repo / "model.pt")
    # low-rank (LoRA merged into the weight)
    R, C = lora(v0)
    v1 = OrderedDict(v0)
    v1[W] = v0[W] + R @ C
    save_pt(repo / "model.pt", v1)
    save_file({f"{G}/R": R, f"{G}/C": C}, str(tmp_path / "lora.safetensors"))
    repo.theta("add", "model.pt", "--update-type", "low-rank", "--update-data", str(tmp_path / "lora.safetensors"))
    repo.commit("lora")
    assert steps(repo) == ["dense", "low-rank"]
    meta = loads(repo.show("HEAD:model.pt"))
    step = meta.groups[G].steps[-1]
    assert step.params["fixes"] == 0                                  # torch's arithmetic reproduced exactly
    assert step.blob.size < 1.1 * (R.numel() + C.numel()) * 4 + 600   # the factors, not the matrix
    # sparse on top of it
    parts, idx, data = sparse_update(v1)
    v2 = OrderedDict(v1)
    flat = v1[W].reshape(-1).clone()
    flat[idx] += data
    v2[W] = flat.reshape(v1[W].shape)
    save_pt(repo / "model.pt", v2)
    save_file(parts, str(tmp_path / "sparse.safetensors"))
    repo.theta("add", "model.pt", "--update-type", "sparse", "--update-data", str(tmp_path / "sparse.safetensors"))
    repo.commit("sparse")
    assert steps(repo) == ["dense", "low-rank", "sparse"]
    # ia3 on top of that
    vec = torch.linspace(0.5, 1.5, v2[W].shape[1]).reshape(1, -1)
    v3 = OrderedDict(v2)
    v3[W] = v2[W] * vec
    save_pt(repo / "model.pt", v3)
    save_file({f"{G}/ia3": vec}, str(tmp_path / "ia3.safetensors"))
    repo.theta("add", "model.pt", "--update-type", "ia3", "--update-data", str(tmp_path / "ia3.safetensors"))
    repo.commit("ia3")
    assert steps(repo) == ["dense", "low-rank", "sparse", "ia3"]
    assert repo.status() == ""

    for rev, want in (("main~3", v0), ("main~2", v1), ("main~1", v2), ("main", v3)):
        repo.git("checkout", "-q", rev)
        assert_bits(load_pt(repo / "model.pt"), want)   # exact: low-rank/ia3 steps carry their fixes
        assert repo.status() == "", rev


@pytest.mark.slow
def test_inferred_and_auto_updates_exact(repo):
    repo.git("config", "theta.keyframeRatio", "inf")  # the steps auto chains, not a keyframe
    v0 = load_pt(repo / "model.pt")
    # auto (plain git add): a few elements changed -> sparse; everything moved a little -> delta
    v1 = OrderedDict(v0)
    v1[W] = v0[W].clone()
    v1[W][3, :5] = 1.0
    v1["layers.1.mlp.weight"] = (v0["layers.1.mlp.weight"].float()
                                 * (1 + 1e-2 * torch.randn(96, 48))).to(torch.bfloat16)
    save_pt(repo / "model.pt", v1)
    repo.commit("auto", "model.pt")
    meta = loads(repo.show("HEAD:model.pt"))
    assert steps(repo)[0] == "dense" and steps(repo)[1] in ("sparse", "delta")   # the smaller (tiny group)
    assert meta.groups[G].steps[1].blob.size < 400
    assert [s.type for s in meta.groups["model/layers.1.mlp.weight"].steps] == ["dense", "delta"]
    # explicit delta; inferred low-rank without side-loaded data
    v2 = OrderedDict(v1)
    v2["embed.weight"] = v1["embed.weight"] * (1 + 1e-3 * torch.randn(128, 48))
    save_pt(repo / "model.pt", v2)
    repo.theta("add", "model.pt", "--update-type", "delta")
    repo.commit("delta")
    assert [s.type for s in loads(repo.show("HEAD:model.pt")).groups["model/embed.weight"].steps] == ["dense", "delta"]
    R, C = lora(v2, rank=3)
    v3 = OrderedDict(v2)
    v3[W] = v2[W] + R @ C
    save_pt(repo / "model.pt", v3)
    repo.theta("add", "model.pt", "--update-type", "low-rank", "-o", "atol=1e-6")
    repo.commit("inferred low-rank")
    assert steps(repo)[::2] == ["dense", "low-rank"]
    assert loads(repo.show("HEAD:model.pt")).groups[G].steps[-1].params["rank"] == 3

    for rev, want in (("main~3", v0), ("main~2", v1), ("main~1", v2), ("main", v3)):
        repo.git("checkout", "-q", rev)
        assert_bits(load_pt(repo / "model.pt"), want)
        assert repo.status() == "", rev


def test_rebase_and_squash_keep_chains_resolvable(repo):
    v0 = load_pt(repo / "model.pt")
    repo.git("checkout", "-q", "-b", "feat")
    versions = [v0]
    for i in range(2):
        v = OrderedDict(versions[-1])
        v[W] = versions[-1][W].clone()
        v[W][i, :4] = float(i + 1)
        save_pt(repo / "model.pt", v)
        repo.commit(f"step {i}", "model.pt")          # plain git add: auto
        versions.append(v)
    assert steps(repo)[0] == "dense" and set(steps(repo)[1:]) <= {"sparse", "delta"} and len(steps(repo)) == 3
    # a new base on main (another file), then rebase the update commits onto it
    repo.git("checkout", "-q", "main")
    (repo / "README").write_text("new base\n")
    repo.commit("readme", "README")
    repo.git("checkout", "-q", "feat")
    repo.git("rebase", "-q", "main")
    for rev, want in (("feat~2", v0), ("feat", versions[2])):
        repo.git("checkout", "-q", rev)
        assert_bits(load_pt(repo / "model.pt"), want)
        assert repo.status() == ""
    # squash the commits into one: the chain is by content, so it still resolves
    repo.git("reset", "-q", "--soft", "main")
    repo.commit("squashed history")
    assert len(repo.out("rev-list", "main..HEAD").split()) == 1
    repo.git("checkout", "-q", "main")
    repo.git("checkout", "-q", "feat")
    assert_bits(load_pt(repo / "model.pt"), versions[2])
    assert repo.status() == ""
    # git theta squash: every group self-contained, staged, working tree untouched
    out = repo.theta("squash", "model.pt").stdout.decode()
    assert "squashed model.pt" in out
    assert [s.type for s in loads(repo.show(":model.pt")).groups[G].steps] == ["dense"]
    assert repo.status() == "M  model.pt"
    repo.commit("self-contained")
    assert steps(repo) == ["dense"] and repo.status() == ""
    repo.git("checkout", "-q", "main")
    repo.git("checkout", "-q", "feat")
    assert_bits(load_pt(repo / "model.pt"), versions[2])


@pytest.mark.slow
def test_max_chain_bounds_the_chain(repo):
    repo.git("config", "theta.maxChain", "2")
    lengths, saved = [], []
    for i in range(3):
        v = OrderedDict(load_pt(repo / "model.pt"))
        v[W] = v[W].clone()
        v[W][10 + i, 0] = -1.0
        save_pt(repo / "model.pt", v)
        repo.commit(f"chain {i}", "model.pt")
        lengths.append(len(steps(repo)))
        saved.append(v)
    assert lengths == [2, 1, 2]   # after a full chain the next version is self-contained
    for back, want in ((2, saved[0]), (0, saved[2])):
        repo.git("checkout", "-q", f"main~{back}")
        assert_bits(load_pt(repo / "model.pt"), want)
        assert repo.status() == ""


def test_single_branch_clone_rebuilds_chain(genv, repo):
    repo.git("config", "theta.keyframeRatio", "inf")  # a step on the previous version, however small the group
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    genv.run(["git", "theta", "install"], cwd=genv.home)
    v0 = load_pt(repo / "model.pt")
    repo.git("push", "-q", "origin", "main")
    repo.git("checkout", "-q", "-b", "feat")
    v1 = OrderedDict(v0)
    v1[W] = v0[W] * (1 + 1e-3 * torch.randn(96, 48))
    save_pt(repo / "model.pt", v1)
    repo.commit("fine-tune", "model.pt")
    assert steps(repo) == ["dense", "delta"]
    repo.git("push", "-q", "origin", "feat")
    assert {s.blob.oid for s in loads(repo.show("HEAD:model.pt")).groups[G].steps} <= bare_lfs_objects(bare.path)
    clone = genv.clone(f"file://{bare.path}", "clone", "--single-branch", "--branch", "feat")
    assert_bits(load_pt(clone / "model.pt"), v1)
    assert clone.status() == ""


@pytest.mark.parametrize("case", ["unknown group", "not the update", *[pytest.param(c, marks=pytest.mark.slow)
                                  for c in ("wrong shape", "missing part", "no type")]])
def test_bad_update_file_stages_nothing(repo, tmp_path, case):
    v0 = load_pt(repo / "model.pt")
    R, C = lora(v0)
    v1 = OrderedDict(v0)
    v1[W] = v0[W] + R @ C
    save_pt(repo / "model.pt", v1)
    tensors = {f"{G}/R": R, f"{G}/C": C}
    args = ["--update-type", "low-rank"]
    if case == "unknown group":
        tensors = {"model/nope.weight/R": R, "model/nope.weight/C": C}
    elif case == "wrong shape":
        tensors[f"{G}/C"] = torch.randn(4, 47)
    elif case == "missing part":
        del tensors[f"{G}/C"]
    elif case == "not the update":
        tensors[f"{G}/R"] = R * 2
    else:
        args = []
    save_file(tensors, str(tmp_path / "upd.safetensors"))
    before = repo.out("ls-files", "-s", "model.pt")
    proc = repo.theta("add", "model.pt", *args, "--update-data", str(tmp_path / "upd.safetensors"), check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert "upd.safetensors" in err, err
    expected = {"unknown group": "'model/nope.weight' is not in the checkpoint", "wrong shape": "not the previous value's",
                "missing part": "lacks part(s) C", "not the update": "differs from the saved model",
                "no type": "--update-type"}[case]
    assert expected in err, err
    assert repo.out("ls-files", "-s", "model.pt") == before
    assert repo.out("diff", "--cached", "--name-only") == ""


# ---------------------------------------------------------------- rows: trimming / extending an embedding

E = "model/embed.weight"


def new_objects_bytes(repo, before: set[str]) -> int:
    d = repo.git_common_dir() / "lfs" / "objects"
    return sum((d / o[:2] / o[2:4] / o).stat().st_size for o in repo.lfs_objects() - before)


@pytest.mark.slow  # (rows steps through git: test_rows_chain_beyond_max_chain_through_git in the default run)
def test_rows_trim_and_append_through_git(repo):
    """Trim an embedding's vocabulary, then append tokens: each commit stores only what is needed (the
    row map, and the new rows), checks out bit for bit, and merges/rebases across it still work."""
    # keyframes off: the trimmed embedding is small enough that its previous version costs more than 1.25 x it
    repo.git("config", "theta.keyframeRatio", "inf")
    v0 = load_pt(repo / "model.pt")
    # trimmed: the last 28 tokens removed from the embedding and the output bias
    v1 = OrderedDict(v0)
    v1["embed.weight"], v1["head.bias"] = v0["embed.weight"][:100].clone(), v0["head.bias"][:100].clone()
    save_pt(repo / "model.pt", v1)
    before = repo.lfs_objects()
    repo.commit("trim vocabulary", "model.pt")
    trimmed = loads(repo.show("HEAD:model.pt")).groups
    assert [s.type for s in trimmed[E].steps] == ["dense", "rows"]
    assert trimmed[E].steps[0].params["shape"] == [128, 48] and "shape" not in trimmed[E].steps[1].params
    assert new_objects_bytes(repo, before) < 600      # two row maps; the dense embedding is 24 KiB
    # appended: 6 new tokens
    g = torch.Generator().manual_seed(5)
    v2 = OrderedDict(v1)
    v2["embed.weight"] = torch.cat([v1["embed.weight"], torch.randn(6, 48, generator=g)])
    v2["head.bias"] = torch.cat([v1["head.bias"], torch.full((6,), 0.5)])
    save_pt(repo / "model.pt", v2)
    before = repo.lfs_objects()
    repo.commit("add tokens", "model.pt")
    assert steps(repo) == steps(repo, "HEAD~1")        # the attention weight is untouched
    groups = loads(repo.show("HEAD:model.pt")).groups
    assert [s.type for s in groups[E].steps] == ["dense", "rows", "rows"]
    assert new_objects_bytes(repo, before) < 6 * 48 * 4 + 600   # ~ the new rows only (1152 bytes raw)
    for rev, want in (("main~2", v0), ("main~1", v1), ("main", v2)):
        repo.git("checkout", "-q", rev)
        assert_bits(load_pt(repo / "model.pt"), want)
        assert repo.status() == "", rev
    repo.git("checkout", "-q", "main")
    # a branch from the base edits another group; merge it into the trimmed+extended main
    repo.git("checkout", "-q", "-b", "feat", "main~2")
    v_feat = OrderedDict(load_pt(repo / "model.pt"))
    v_feat[W] = v_feat[W].clone()
    v_feat[W][3, :5] = 2.0
    save_pt(repo / "model.pt", v_feat)
    edit = repo.commit("edit attention", "model.pt")
    want = OrderedDict(v2)
    want[W] = v_feat[W]
    repo.git("checkout", "-q", "-b", "merged", "main")
    repo.git("merge", "-q", "--no-edit", "feat")
    assert_bits(load_pt(repo / "model.pt"), want)
    assert repo.status() == ""
    # rebase the feature onto main: the replayed commit keeps main's reshaped embedding
    repo.git("checkout", "-q", "feat")
    repo.git("rebase", "-q", "main")
    assert_bits(load_pt(repo / "model.pt"), want)
    assert repo.status() == ""
    # and rebase main's trim/append commits onto the feature's edit (the chains resolve by content)
    repo.git("checkout", "-q", "-b", "vocab", "main")
    repo.git("rebase", "-q", edit)
    for rev, w in (("vocab~1", OrderedDict(v1, **{W: v_feat[W]})), ("vocab", want)):
        repo.git("checkout", "-q", rev)
        assert_bits(load_pt(repo / "model.pt"), w)
        assert repo.status() == "", rev


def test_rows_chain_beyond_max_chain_through_git(repo):
    """theta.maxChain=2 with trims and appends: the chain is rebuilt self-contained when full, and every
    commit (reshaped chains, self-contained restarts) checks out bit for bit with a clean status."""
    repo.git("config", "theta.maxChain", "2")
    g = torch.Generator().manual_seed(9)
    saved, lengths = [load_pt(repo / "model.pt")], []
    for i, n in enumerate((120, 124, 110, 111)):
        v = OrderedDict(saved[-1])
        e = saved[-1]["embed.weight"]
        v["embed.weight"] = e[:n].clone() if n < e.shape[0] else torch.cat([e, torch.randn(n - e.shape[0], 48,
                                                                                          generator=g)])
        save_pt(repo / "model.pt", v)
        repo.commit(f"resize {i}", "model.pt")
        lengths.append(len(loads(repo.show("HEAD:model.pt")).groups[E].steps))
        saved.append(v)
    assert lengths == [2, 1, 2, 1]
    for back in range(len(saved)):
        repo.git("checkout", "-q", f"main~{back}")
        assert_bits(load_pt(repo / "model.pt"), saved[-1 - back])
        assert repo.status() == "", back
