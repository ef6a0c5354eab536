"""What git sends a clean is what is stored, whether it is the work-tree file (cleaned in place) or other
bytes for that path (spooled), and a refused clean leaves nothing behind. Real git, real git-lfs, real torch
files."""
from __future__ import annotations

import os

import hashlib

import pytest
import torch

from theta.storage.metadata import loads

from support.checkpoints import make_state, save_pt
from support.crafted import leftovers
from support.gitrepo import GitEnv


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def tuned(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + 1e-3 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
            for k, v in state.items()}


def test_a_first_clean_of_other_bytes_than_the_work_tree_file_stores_the_bytes_git_sent(genv):
    """`git hash-object --path=model.pt other.pt` sends other.pt's bytes for model.pt: they are spooled (the
    work-tree file differs) and the metadata is that of other.pt, the same text `git add` of those bytes at
    model.pt writes."""
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = tuned(v1, 2)
    save_pt(repo / "other.pt", v2)
    oid = repo.out("hash-object", "-w", "--path=model.pt", "other.pt").strip()
    text = repo.show(oid)
    assert leftovers(repo) == []
    (repo / "model.pt").write_bytes((repo / "other.pt").read_bytes())
    repo.git("add", "model.pt")
    assert repo.show(":model.pt") == text
    meta = loads(text)
    for name, value in v2.items():  # the values other.pt holds (raw bytes of each tensor), not model.pt's
        raw = value.contiguous().view(torch.uint8).numpy().tobytes() if value.dim() else value.numpy().tobytes()
        assert meta.group_for(f"model/{name}").hash == hashlib.sha256(raw).hexdigest(), name


def test_a_refused_first_clean_leaves_nothing_and_stages_nothing(genv):
    """The first file git cleans is an unsafe checkpoint: the add fails naming it, no spool, no temp file,
    no lock, nothing staged; the next add of a good file works in a fresh filter."""
    repo = genv.init("work", track=("*.pt",))

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"w": torch.zeros(2), "x": Evil()}, repo / "a.pt")
    save_pt(repo / "b.pt", make_state(3))
    proc = repo.git("add", "a.pt", "b.pt", check=False)
    assert proc.returncode != 0 and b"a.pt" in proc.stderr and b"system" in proc.stderr
    assert repo.out("ls-files") == ""
    assert not (repo.git_common_dir() / "index.lock").exists()
    assert leftovers(repo) == []
    # the same unsafe bytes sent for another path: received through a spool this time, which is removed
    proc = repo.git("hash-object", "--path=b.pt", "a.pt", check=False)
    assert proc.returncode != 0 and b"system" in proc.stderr
    assert leftovers(repo) == []
    repo.git("add", "b.pt")
    assert repo.out("ls-files").split() == ["b.pt"] and "model/embed.weight" in loads(repo.show(":b.pt")).groups
