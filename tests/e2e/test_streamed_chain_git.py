"""The streamed paths through the real git, git-lfs and theta filter, on a small model: an embedding grown
and fine-tuned in one commit, side-loaded IA3 and LoRA updates on top, three fine-tunes (the embedding's chain is
then 8 steps: dense, rows, delta, ia3, low-rank and deltas), a checkout of every commit and `git theta squash` of
the tip. Every checkout gives the saved file's values bit for bit and leaves `git status` clean. Values only:
the memory bound is measured by scripts/bench/git.py (tests/e2e/test_memory_bounds.py)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file

from support.gitrepo import GitEnv
from theta.storage.metadata import loads

E = "embed.weight"


def base_state() -> OrderedDict:
    g = torch.Generator().manual_seed(0)
    return OrderedDict([(E, torch.randn(120, 32, generator=g) * 0.02),
                        ("attn.weight", torch.randn(48, 32, generator=g) * 0.02),
                        ("attn.bias", torch.zeros(48))])


def tune(sd: OrderedDict, seed: int) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    return OrderedDict((k, v * (1 + 1e-3 * torch.randn(v.shape, generator=g))) for k, v in sd.items())


def assert_bits(got: OrderedDict, want: OrderedDict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k


def chain(repo, rev: str = "HEAD") -> list[str]:
    return [s.type for s in loads(repo.show(f"{rev}:model.pt")).groups[E].steps]


@pytest.fixture
def repo(tmp_path):
    return GitEnv.create(tmp_path).init("work")


def test_grown_side_loaded_chain_of_8_round_trips_and_squashes(repo, tmp_path):
    versions: list[tuple[str, OrderedDict]] = []

    def commit(sd: OrderedDict, message: str, *theta_add: str) -> str:
        torch.save(sd, repo / "model.pt")
        if theta_add:
            repo.theta("add", "model.pt", *theta_add)
            rev = repo.commit(message)
        else:
            rev = repo.commit(message, ".gitattributes", "model.pt")
        versions.append((rev, sd))
        return rev

    # keyframes off: the embedding is small enough that a grown and fine-tuned version would be a keyframe, and
    # this is about a long chain of every kind of step
    repo.git("config", "theta.keyframeRatio", "inf")
    v0 = base_state()
    commit(v0, "base")
    # grown by 8 rows while every existing row changes a little: a positional rows step, then the change
    g = torch.Generator().manual_seed(1)
    v1 = tune(v0, 2)
    v1[E] = torch.cat([v1[E], torch.randn(8, 32, generator=g) * 0.02])
    commit(v1, "grow and fine-tune")
    assert chain(repo)[:2] == ["dense", "rows"] and chain(repo)[2] in ("delta", "sparse")
    # IA3 (torch's float32 product) side-loaded on the embedding and the attention matrix
    vecs = {k: 1 + 0.01 * torch.randn(1, v1[k].shape[1], generator=g) for k in (E, "attn.weight")}
    save_file({f"{k}/ia3": v for k, v in vecs.items()}, str(tmp_path / "ia3.safetensors"))
    v2 = OrderedDict((k, v * vecs[k] if k in vecs else v) for k, v in v1.items())
    commit(v2, "ia3", "--update-type", "ia3", "--update-data", str(tmp_path / "ia3.safetensors"))
    assert chain(repo)[-1] == "ia3"
    # LoRA (torch's matmul) side-loaded on the embedding
    R, C = torch.randn(128, 4, generator=g) * 0.05, torch.randn(4, 32, generator=g) * 0.05
    save_file({f"{E}/R": R, f"{E}/C": C}, str(tmp_path / "lora.safetensors"))
    v3 = OrderedDict(v2, **{E: v2[E] + R @ C})
    commit(v3, "lora", "--update-type", "low-rank", "--update-data", str(tmp_path / "lora.safetensors"))
    assert chain(repo)[-1] == "low-rank"
    sd = v3
    for i in range(3):
        sd = tune(sd, 10 + i)
        commit(sd, f"fine-tune {i}")
    tip = versions[-1][0]
    assert len(chain(repo)) == 8 and chain(repo)[:5] == ["dense", "rows", chain(repo)[2], "ia3", "low-rank"]
    # the base, the grown, the LoRA commit and the tip (8 steps) check out bit for bit, status clean
    for rev, want in (versions[0], versions[1], versions[3], versions[-1]):
        repo.git("checkout", "-q", rev)
        assert_bits(torch.load(repo / "model.pt", weights_only=True), want)
        assert repo.status() == ""
    repo.git("checkout", "-q", "main")
    assert repo.out("rev-parse", "HEAD") == tip
    # squash: one dense step per group, the same values, the work tree untouched and clean
    repo.theta("squash", "model.pt")
    repo.commit("squash")
    assert chain(repo) == ["dense"]
    assert repo.status() == ""
    repo.git("checkout", "-q", versions[0][0])
    repo.git("checkout", "-q", "main")
    assert_bits(torch.load(repo / "model.pt", weights_only=True), versions[-1][1])
