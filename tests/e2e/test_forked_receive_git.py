"""Real git, real git-lfs, real torch files: the first clean of a filter has git's bytes received by a forked
child (theta.commands.filter.forked_receive) and stores exactly what the filter alone stores (GIT_THETA_FORK_RECEIVE=0),
for files whose members are groups, views sharing a storage, other bytes sent for the path, and a child
killed in the middle."""
from __future__ import annotations

import pytest
import torch

from support.checkpoints import make_state, save_pt
from support.crafted import leftovers
from support.gitrepo import GitEnv

ALONE = {"GIT_THETA_FORK_RECEIVE": "0"}
TIMED = {"GIT_THETA_TIMING": "1", "GIT_THETA_THREADS": "2"}  # (one thread forks no child)


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def shared_state(seed: int) -> dict:
    """Groups that are whole storages, and views that share one (tied, a slice, a transpose)."""
    sd = make_state(seed)
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(seed))
    sd["tied.a"] = base
    sd["tied.b"] = base
    sd["slice"] = base[8:40]
    sd["t"] = base.t()
    return sd


def staged_twice(repo, path: str, env: dict) -> tuple[bytes, bytes]:
    """The text `git add` stages for ``path`` with the child and without it (the index reset in between)."""
    texts = []
    for extra in ({**TIMED}, {**TIMED, **env}):
        repo.git("rm", "-q", "--cached", "--ignore-unmatch", path)
        proc = repo.git("add", path, extra_env=extra)
        texts.append((repo.show(f":{path}"), proc.stderr))
    (a, log_a), (b, log_b) = texts
    assert b"received by a forked child" in log_a and b"received by a forked child" not in log_b
    return a, b


def test_git_add_through_the_child_stores_what_the_filter_alone_stores(genv):
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", shared_state(1))
    first, alone = staged_twice(repo, "model.pt", ALONE)
    assert first == alone
    repo.commit("v1")
    sd = shared_state(1)
    sd["layers.1.mlp.weight"] = sd["layers.1.mlp.weight"] * 1.5  # one group changed, the rest reused
    save_pt(repo / "model.pt", sd)
    changed, alone = staged_twice(repo, "model.pt", ALONE)
    assert changed == alone and changed != first
    repo.git("commit", "-q", "-m", "v2")
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    got = torch.load(repo / "model.pt", weights_only=True)["model"]
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert leftovers(repo) == []


def test_other_bytes_sent_for_the_path_are_spooled_by_the_child_and_stored(genv):
    """`git hash-object --stdin --path=model.pt` sends other.pt's bytes under model.pt's name: the child
    finds they are not the file's and spools them; the text is what the filter alone makes of them."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    repo.commit("v1", ".gitattributes", "model.pt")
    save_pt(repo / "other.pt", make_state(2))
    other = (repo / "other.pt").read_bytes()
    texts = []
    for extra in (TIMED, {**TIMED, **ALONE}):
        proc = repo.git("hash-object", "--stdin", "--path=model.pt", input=other, extra_env=extra)
        texts.append(proc.stdout)
    assert texts[0] == texts[1]
    assert leftovers(repo) == []
    (repo / "model.pt").write_bytes(other)
    repo.git("add", "model.pt")
    assert repo.out("rev-parse", ":model.pt") == texts[0].decode().strip()


def test_a_child_killed_while_receiving_fails_the_add_and_leaves_nothing(genv):
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    proc = repo.git("add", ".gitattributes", "model.pt", check=False,
                    extra_env={"GIT_THETA_FAULT": "receive:forked:2", "GIT_THETA_THREADS": "2"})
    assert proc.returncode != 0 and b"model.pt" in proc.stderr
    assert b"git-theta" in proc.stderr  # git names the filter that failed
    assert "model.pt" not in repo.out("ls-files")
    assert not (repo.git_common_dir() / "index.lock").exists()
    assert leftovers(repo) == []
    repo.git("add", "model.pt")
    assert "model/embed.weight" in repo.show(":model.pt").decode()
