"""The round-3 cases of the memory bound through real git, git-lfs and the theta filter, on a small model, values
only (the memory is measured by scripts/bench/git.py: tests/e2e/test_memory_bounds.py): ia3 and low-rank steps
inferred without update data (the stored steps against the whole-group implementation they replaced, the
checkout bit for bit); Git-Theta's original-form LoRA side-load (the rewritten file bit for bit what the
whole-group arithmetic wrote); a commit pruning every matrix to 50% zeros (sparse steps changing half of a group)
checked out bit for bit; the merge of two fine-tunes of a vocabulary pruned in the middle (rows moved, read by
position) equal bit for bit to the strategy applied to the whole values."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from support import reference_updates as ref
from support.gitrepo import GitEnv
from theta.storage import codec
from theta.storage.metadata import loads
from theta.storage.store import LfsStore

E = "embed.weight"


def base_state() -> OrderedDict:
    g = torch.Generator().manual_seed(0)
    return OrderedDict([(E, torch.randn(300, 48, generator=g) * 0.02),
                        ("attn.weight", torch.randn(64, 48, generator=g) * 0.02),
                        ("attn.bias", torch.zeros(64))])


def tune(sd: OrderedDict, seed: int) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    return OrderedDict((k, v * (1 + 1e-3 * torch.randn(v.shape, generator=g))) for k, v in sd.items())


def bits(t) -> bytes:
    return np.ascontiguousarray(np.asarray(t)).reshape(-1).view(np.uint8).tobytes()


def assert_bits(got: OrderedDict, want: OrderedDict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert bits(got[k].numpy()) == bits(v.numpy()), k


def group(repo, name: str = E, rev: str = "HEAD"):
    return loads(repo.show(f"{rev}:model.pt")).groups[name]


def last_parts(repo, name: str = E) -> dict:
    step = group(repo, name).steps[-1]
    store = LfsStore.for_repo(repo.path)
    with store.mapped(step.blob) as blob:
        return codec.decode_parts(blob)


@pytest.fixture
def repo(tmp_path):
    return GitEnv.create(tmp_path).init("work")


def commit(repo, sd: OrderedDict, message: str, *theta_add: str) -> str:
    torch.save(sd, repo / "model.pt")
    if theta_add:
        repo.theta("add", "model.pt", *theta_add)
        return repo.commit(message)
    return repo.commit(message, ".gitattributes", "model.pt")


def checked_out(repo, rev: str) -> OrderedDict:
    repo.git("checkout", "-q", rev)
    assert repo.status() == ""
    return torch.load(repo / "model.pt", weights_only=True)


def test_inferred_ia3_and_low_rank_steps_match_the_whole_group_inference(repo):
    v0 = base_state()
    r0 = commit(repo, v0, "base")
    g = torch.Generator().manual_seed(1)
    vec = 1 + 0.01 * torch.randn(1, 48, generator=g)
    v1 = OrderedDict((k, v * vec if k == E else v) for k, v in v0.items())
    r1 = commit(repo, v1, "ia3 inferred", "--update-type", "ia3")
    assert group(repo).steps[-1].type == "ia3"
    got = last_parts(repo)
    want = ref.ia3_encode(v1[E].numpy(), v0[E].numpy())
    # the float64 sums are added block after block: the float32 vector within one ulp (here: the same bits)
    assert np.all(np.abs(got["ia3"].astype(np.float64) - want.parts["ia3"])
                  <= np.spacing(np.abs(want.parts["ia3"])).astype(np.float64))
    R, C = torch.randn(300, 3, generator=g) * 0.05, torch.randn(3, 48, generator=g) * 0.05
    v2 = OrderedDict(v1, **{E: v1[E] + R @ C})
    r2 = commit(repo, v2, "low-rank inferred", "--update-type", "low-rank")
    assert group(repo).steps[-1].type == "low-rank"
    got = last_parts(repo)
    want = ref.low_rank_encode(v2[E].numpy(), v1[E].numpy())
    assert got["R"].shape == want.parts["R"].shape == (300, 3)
    wrc = want.parts["R"].astype(np.float64) @ want.parts["C"]
    assert np.max(np.abs(got["R"].astype(np.float64) @ got["C"] - wrc)) <= 1e-6 * np.max(np.abs(wrc))
    for rev, want_sd in ((r1, v1), (r2, v2)):
        assert_bits(checked_out(repo, r0), v0)
        assert_bits(checked_out(repo, rev), want_sd)


def test_original_form_low_rank_side_load_rewrites_the_same_bytes(repo, tmp_path):
    v0 = base_state()
    commit(repo, v0, "base")
    g = torch.Generator().manual_seed(2)
    R, C = torch.randn(300, 4, generator=g) * 0.05, torch.randn(4, 48, generator=g) * 0.05
    save_file({f"{E}/R": R, f"{E}/C": C}, str(tmp_path / "lora.safetensors"))
    # the work tree holds the model before the update (Git-Theta's documented workflow): theta rewrites it
    repo.theta("add", "model.pt", "--update-type", "low-rank", "--update-data", str(tmp_path / "lora.safetensors"))
    rewritten = torch.load(repo / "model.pt", weights_only=True)
    # what the whole-group arithmetic wrote: R @ C + previous (numpy, as Git-Theta computes it)
    want = R.numpy() @ C.numpy() + v0[E].numpy()
    assert bits(rewritten[E].numpy()) == bits(want)
    assert_bits(OrderedDict((k, v) for k, v in rewritten.items() if k != E),
                OrderedDict((k, v) for k, v in v0.items() if k != E))
    rev = repo.commit("lora, original form")
    assert group(repo).steps[-1].type == "low-rank"
    assert_bits(checked_out(repo, "HEAD~1"), v0)
    assert_bits(checked_out(repo, rev), rewritten)


def test_half_pruned_commit_stores_sparse_steps_and_checks_out_bit_for_bit(repo):
    repo.git("config", "theta.keyframeRatio", "inf")  # keyframes off: the sparse step itself, whatever it costs
    v0 = base_state()
    commit(repo, v0, "base")

    def prune(t):
        if t.ndim != 2:
            return t
        return torch.where(t.abs() < t.abs().median(), torch.zeros_like(t), t)
    v1 = OrderedDict((k, prune(v)) for k, v in v0.items())
    rev = commit(repo, v1, "pruned")
    assert group(repo).steps[-1].type == "sparse"
    assert group(repo).steps[-1].params["count"] >= 0.49 * v0[E].numel()
    assert_bits(checked_out(repo, "HEAD~1"), v0)
    assert_bits(checked_out(repo, rev), v1)
    v2 = tune(v1, 3)  # a commit on top rebuilds the half-changed value as its previous one
    commit(repo, v2, "tuned")
    assert_bits(checked_out(repo, "HEAD~1"), v1)


@pytest.mark.parametrize("strategy", ["average", "task-arithmetic"])
def test_merge_of_chains_whose_rows_moved_equals_the_whole_value_merge(repo, strategy):
    from theta.merges import get as get_strategy

    repo.git("config", "theta.keyframeRatio", "inf")  # keyframes off: chains with rows steps on every side
    v0 = base_state()
    commit(repo, v0, "base")
    cut = OrderedDict(v0, **{E: torch.cat([v0[E][:50], v0[E][80:]])})  # 30 rows deleted in the middle
    commit(repo, cut, "vocabulary pruned in the middle")
    repo.git("branch", "side")
    ours = tune(cut, 4)
    commit(repo, ours, "ours")
    repo.git("checkout", "-q", "side")
    theirs = tune(cut, 5)
    commit(repo, theirs, "theirs")
    assert [s.type for s in group(repo).steps] == ["dense", "rows", "delta"]
    repo.git("merge", "-q", "--no-edit", "main", extra_env={"GIT_THETA_MERGE_STRATEGY": strategy})
    assert repo.status() == ""
    merged = torch.load(repo / "model.pt", weights_only=True)
    s = get_strategy(strategy)
    for k in v0:
        a, b, o = theirs[k].numpy(), ours[k].numpy(), cut[k].numpy()  # HEAD is theirs: "ours" of the merge
        if bits(a) == bits(b):
            want = a
        else:
            want = s.merge(k, a, b, o if s.needs_ancestor else None)
        assert bits(merged[k].numpy()) == bits(want), k
