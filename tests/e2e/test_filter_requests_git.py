"""What git sends a clean is what is stored, whether it is the work-tree file (cleaned in place) or other
bytes for that path (spooled), and a refused clean leaves nothing behind. Real git, real git-lfs, real torch
files."""
from __future__ import annotations

import os

import pytest
import torch

from theta.base import valuehash
from theta.storage.metadata import loads

from support.checkpoints import assert_same_checkpoint, make_state, save_pt
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
        assert meta.group_for(f"model/{name}").hash == valuehash.new(raw).hexdigest(), name


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


def test_git_add_hashes_the_groups_git_sends_and_stores_what_a_spooled_clean_stores(genv):
    """In `git add` the groups are recognized from the hashes of git's own bytes (theta.model.git_bytes): the text
    is byte for byte the one a clean of a spooled copy writes, for a partial change and a full fine-tune."""
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    partial = dict(v1)
    partial.update({k: v for i, (k, v) in enumerate(tuned(v1, 4).items()) if i % 5 == 0})
    for version in (partial, tuned(v1, 5)):
        save_pt(repo / "model.pt", version)
        proc = repo.git("add", "model.pt", extra_env={"GIT_THETA_TIMING": "1"})
        hashed = int(proc.stderr.decode().split(" groups hashed from them")[0].rsplit(" ", 1)[1])
        assert hashed == len(loads(repo.show(":model.pt")).groups), proc.stderr
        text = repo.show(":model.pt")
        repo.git("reset", "-q")
        repo.git("add", "model.pt", extra_env={"GIT_THETA_SPOOL": "always"})
        assert repo.show(":model.pt") == text
        repo.git("reset", "-q")
    assert leftovers(repo) == []


def test_a_group_that_is_not_the_work_tree_files_in_an_add_is_refused_and_leaves_nothing(genv, monkeypatch):
    """git's bytes of one group differ from the work-tree file's (the file was rewritten while git read it):
    only the group's hash was kept, so the clean refuses, naming the file and the group, and leaves no
    spool; the same bytes sent by `git hash-object` are compared byte by byte and spooled instead."""
    from theta.commands.filter.session import Filter
    from theta.base.errors import ThetaError
    from zipslice import load

    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    data = (repo / "model.pt").read_bytes()
    with load(repo / "model.pt") as lsd:
        _, offset, nbytes = lsd.plain_range("model/layers.1.mlp.weight")
    sent = bytearray(data)
    sent[offset + nbytes // 2 + 3] ^= 0x40  # an exponent bit of one weight: far beyond the tolerance
    for k, v in genv.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(repo.path)
    for invoker, refused in (("add", True), ("hash-object", False)):
        filt = Filter(repo.path)
        filt._invoker = invoker
        packets = iter([bytes(sent[i:i + 65516]) for i in range(0, len(sent), 65516)])
        if refused:
            with pytest.raises(ThetaError, match=r"model.pt: group 'model/layers.1.mlp.weight' changed "
                                                 r"while git was reading the file"):
                filt.clean("model.pt", packets)
        else:  # a spooled copy of git's bytes: cleaned as they are (the changed group is stored anew)
            meta = loads(filt.clean("model.pt", packets))
            assert meta.groups["model/layers.1.mlp.weight"].hash != \
                loads(repo.show("HEAD:model.pt")).groups["model/layers.1.mlp.weight"].hash
        filt.close()
        assert leftovers(repo) == []


def test_a_big_group_is_cleaned_frame_by_frame_in_git_add_and_checks_out_bit_for_bit(genv):
    """A group above theta.model.framewise.STREAM_BYTES (40 MiB) goes through one frame pass in a real `git add`,
    against the hashes of git's own bytes: first stored dense, then as a delta of a fine-tune; both versions
    check out bit for bit, and the status is clean."""
    from theta.model import framewise

    repo = genv.init("work", track=("*.pt",))
    g = torch.Generator().manual_seed(0)
    v1 = {"embed": torch.randn(10240, 1024, generator=g) * 0.02, "bias": torch.zeros(1024)}
    assert v1["embed"].numel() * 4 > framewise.STREAM_BYTES
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = tuned(v1, 3)
    save_pt(repo / "model.pt", v2)
    proc = repo.git("add", "model.pt", extra_env={"GIT_THETA_TIMING": "1"})
    assert " 2 groups hashed from them" in proc.stderr.decode(), proc.stderr
    repo.commit("v2", "model.pt")
    meta = loads(repo.show("HEAD:model.pt"))
    assert [s.type for s in meta.groups["model/embed"].steps] == ["dense", "delta"]
    assert meta.groups["model/embed"].hash == valuehash.new(v2["embed"].numpy().tobytes()).hexdigest()
    repo.git("checkout", "-q", "HEAD~1")
    assert_same_checkpoint(repo / "model.pt", v1)
    repo.git("checkout", "-q", "main")
    assert_same_checkpoint(repo / "model.pt", v2)
    assert repo.git("status", "--porcelain").stdout == b""
    assert leftovers(repo) == []


def test_git_add_with_one_thread_completes_and_stores_what_two_threads_store(genv):
    """GIT_THETA_THREADS=1 runs every pool inline, the early clean too: it must not wait for git's bytes, which
    only the request's own thread receives after it (a first add hung there for good). A first version, a
    partial change and a full fine-tune, each added with one thread and then with two: the same text."""
    import subprocess

    repo = genv.init("work", track=("*.pt",))
    repo.commit("attributes", ".gitattributes")
    v1 = make_state(1)
    partial = dict(v1)
    partial.update({k: v for i, (k, v) in enumerate(tuned(v1, 4).items()) if i % 5 == 0})
    for version in (v1, partial, tuned(v1, 5)):
        save_pt(repo / "model.pt", version)
        texts = []
        for threads in ("1", "2"):
            # in a session of its own: a hung add fails the test, and its filter is killed with it
            proc = subprocess.Popen(["git", "add", "model.pt"], cwd=repo.path, stderr=subprocess.PIPE,
                                    env={**genv.env, "GIT_THETA_THREADS": threads}, start_new_session=True)
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.communicate()
                pytest.fail(f"git add with GIT_THETA_THREADS={threads} did not finish in 120 s")
            assert proc.returncode == 0, err
            texts.append(repo.show(":model.pt"))
            repo.git("reset", "-q")
        assert texts[0] == texts[1]
        repo.commit("version", "model.pt")
    assert leftovers(repo) == []
