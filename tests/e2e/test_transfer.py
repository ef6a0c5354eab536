"""Clone, pull and resume through a real LFS server (giftless on 127.0.0.1) with real git and git-lfs: what
crosses the wire, counted by the server.

- a fresh clone downloads exactly the blobs of the checked-out version's chains -- its high parts and one step
  per fine-tuned group -- in one git-lfs run; what a clone of any commit fetches is within 3 % of that version
  stored alone (dense); a pull downloads only the new steps;
- a pull or a clone killed (-9, the whole process group) while its blobs download leaves the work tree a
  placeholder, and `git theta pull` then downloads only what is missing: complete objects are not asked for
  again, a partial one is resumed from where it stopped (git-lfs's ``lfs/incomplete``, an HTTP range request);
- downloads run ``lfs.concurrenttransfers`` at a time (the clone's).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import OrderedDict

import pytest
import torch
from scripts.bench.lfs_server import GiftlessServer
from support.checkpoints import assert_same_checkpoint, save_pt
from support.gitrepo import GitEnv, Repo

from theta.storage import codec
from theta.storage.metadata import loads

pytestmark = pytest.mark.lfs_server

GROUPS, ROWS, COLS = 4, 512, 512  # 1 MiB float32 groups: split keyframes


def model(seed: int = 0) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict((f"layer{i}.weight", torch.randn(ROWS, COLS, generator=g) * 0.02) for i in range(GROUPS))
    sd["bias"] = torch.randn(COLS, generator=g) * 0.02
    return sd


def tuned(sd: OrderedDict, seed: int) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    return OrderedDict((k, v * (1 + 1e-3 * torch.randn(v.shape, generator=g))) for k, v in sd.items())


@pytest.fixture
def published(tmp_path):
    """A server, a repository whose history (base, two fine-tunes) is pushed to it, and the versions."""
    genv = GitEnv.create(tmp_path)
    genv.run(["git", "theta", "install"], cwd=genv.home)
    with GiftlessServer(tmp_path / "lfs-store") as server:
        url = server.lfs_url("org", "model")
        genv.run(["git", "config", "--global", "lfs.url", url], cwd=genv.home)
        repo = genv.init("work")
        bare = genv.init("remote.git", theta=False, bare=True)
        repo.git("remote", "add", "origin", str(bare.path))
        versions = [model()]
        versions += [tuned(versions[-1], 1)]
        versions += [tuned(versions[-1], 2)]
        for i, sd in enumerate(versions):
            save_pt(repo / "model.pt", sd)
            repo.commit(f"v{i + 1}", ".gitattributes", "model.pt")
        repo.git("push", "-q", "origin", "main")
        yield genv, server, repo, bare, versions


def chain_blobs(repo, rev: str) -> dict[str, int]:
    meta = loads(repo.show(f"{rev}:model.pt"))
    return {s.blob.oid: s.blob.size for g in meta.groups.values() for s in g.steps}


def test_a_clone_fetches_its_version_and_a_pull_only_the_new_steps(published):
    genv, server, repo, bare, versions = published
    server.throttle(8 << 20)  # downloads overlap: lfs.concurrenttransfers is seen at work
    genv.run(["git", "config", "--global", "lfs.concurrenttransfers", "3"], cwd=genv.home)
    before = len(server.requests())
    clone = genv.clone(str(bare.path), "clone")
    assert_same_checkpoint(clone / "model.pt", versions[-1])
    got = server.requests()[before:]
    assert max(r["inflight"] for r in got if r["kind"] == "download") == 3  # never more, and the run used them
    server.throttle(None)
    head = chain_blobs(repo, "HEAD")
    served = {r["oid"]: r["sent"] for r in got if r["kind"] == "download"}
    assert served == head  # every blob of the version's chains, each once and whole, nothing else
    assert len([r for r in got if r["kind"] == "batch"]) == 1  # one git-lfs run, one batch request
    for back, sd in enumerate(reversed(versions)):  # a clone of any commit: about what its version alone costs
        dense = sum(len(codec.encode_parts({"values": v.numpy()})) for v in sd.values())
        fetched = sum(chain_blobs(repo, f"HEAD~{back}").values())
        assert dense <= fetched <= 1.03 * dense, (back, fetched / dense)
    meta = loads(repo.show("HEAD:model.pt"))
    first = loads(repo.show("HEAD~2:model.pt"))
    for i in range(GROUPS):  # two fine-tunes on: the first version's high part and one step
        steps = meta.groups[f"model/layer{i}.weight"].steps
        assert len(steps) == 2 and steps[0] == first.groups[f"model/layer{i}.weight"].steps[0]

    v4 = tuned(versions[-1], 3)
    save_pt(repo / "model.pt", v4)
    repo.commit("v4", "model.pt")
    repo.git("push", "-q", "origin", "main")
    before = len(server.requests())
    clone.git("pull", "-q", "--ff-only")
    assert_same_checkpoint(clone / "model.pt", v4)
    pulled = {r["oid"]: r["sent"] for r in server.requests()[before:] if r["kind"] == "download"}
    new = {o: n for o, n in chain_blobs(repo, "HEAD").items() if o not in head}
    assert pulled == new
    raw = sum(v.numel() * 4 for v in v4.values())
    assert sum(pulled.values()) < 0.6 * raw  # a split step per group: its low bits and its high bits' change


def _lfs_state(clone) -> tuple[set[str], dict[str, int]]:
    """(complete objects, partial downloads: oid -> bytes) in the clone's LFS store."""
    lfs_dir = clone.git_common_dir() / "lfs"
    incomplete = lfs_dir / "incomplete"  # git-lfs 3: <oid><random digits> while it downloads
    partial = {p.name[:64]: p.stat().st_size for p in incomplete.iterdir() if len(p.name) > 64} \
        if incomplete.is_dir() else {}
    return clone.lfs_objects(), partial


def _gone(pgid: int, timeout: float = 30) -> None:
    """Wait until no process of group ``pgid`` is left (git-lfs, a grandchild, dies after git)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _kill_midway(proc: subprocess.Popen, clone, new: dict[str, int]) -> tuple[set[str], dict[str, int]]:
    """Kill ``proc``'s whole process group (git, the filter, the hook, git-lfs) once ``clone``'s store holds a
    complete and a partial object of ``new``; returns (the objects of ``new`` complete, the partial downloads)."""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if (clone / ".git" / "lfs").is_dir():
                done, partial = _lfs_state(clone)
                if done & set(new) and any(n > 0 for o, n in partial.items() if o in new):
                    break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.01)
        else:
            pytest.fail("the command never had a complete and a partial object at once")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _gone(proc.pid)
    done, partial = _lfs_state(clone)
    had = {o for o in done if o in new}
    assert had and partial and not set(partial) & had
    assert (clone / "model.pt").read_bytes().startswith(b"theta-metadata ")  # a placeholder, not half a file
    return had, partial


def _resumed_with_what_is_missing(clone, server, new: dict[str, int], had: set[str], partial: dict[str, int],
                                  version) -> None:
    """`git theta pull` completes the checkout, asking only for what is missing and resuming partial objects."""
    server.throttle(None)
    cut = len(server.requests())
    clone.theta("pull")
    assert_same_checkpoint(clone / "model.pt", version)
    assert clone.status() == ""
    again = [r for r in server.requests()[cut:] if r["kind"] == "download"]
    assert {r["oid"] for r in again} == set(new) - had  # nothing complete is asked for again
    for r in again:
        if r["oid"] in partial:  # resumed where it stopped: only the rest crosses the wire
            assert r["first"] == partial[r["oid"]] and r["sent"] == new[r["oid"]] - partial[r["oid"]]
        else:
            assert r["first"] == 0 and r["sent"] == new[r["oid"]]


def _started(genv, args: list[str], cwd) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=cwd, env=genv.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


@pytest.mark.slow  # ~20 s; tests/theta/test_lfs_partials.py checks the adoption of partial files by itself
def test_a_pull_killed_while_downloading_resumes_with_what_is_missing(published):
    genv, server, repo, bare, versions = published
    clone = genv.clone(str(bare.path), "clone")
    clone.git("config", "lfs.concurrenttransfers", "1")  # one object at a time: a kill finds one partial
    v4 = tuned(versions[-1], 3)
    save_pt(repo / "model.pt", v4)
    repo.commit("v4", "model.pt")
    repo.git("push", "-q", "origin", "main")
    new = {o: n for o, n in chain_blobs(repo, "HEAD").items() if o not in clone.lfs_objects()}
    assert len(new) >= GROUPS

    server.throttle(2 << 20)  # 2 MiB/s: each ~0.5 MiB step takes a quarter of a second
    before = len(server.requests())
    had, partial = _kill_midway(_started(genv, ["git", "pull", "-q", "--ff-only"], clone.path), clone, new)
    first_try = [r for r in server.requests()[before:] if r["kind"] == "download"]
    assert all(r["inflight"] == 1 for r in first_try)  # lfs.concurrenttransfers 1: one download at a time
    _resumed_with_what_is_missing(clone, server, new, had, partial, v4)


@pytest.mark.slow  # ~20 s
def test_a_clone_killed_while_downloading_resumes_with_what_is_missing(published):
    genv, server, repo, bare, versions = published
    genv.run(["git", "config", "--global", "lfs.concurrenttransfers", "1"], cwd=genv.home)
    new = chain_blobs(repo, "HEAD")  # a fresh clone has none of them
    server.throttle(2 << 20)
    clone = Repo(genv.home.parent / "clone", genv)
    had, partial = _kill_midway(_started(genv, ["git", "clone", "-q", str(bare.path), str(clone.path)], genv.home),
                                clone, new)
    _resumed_with_what_is_missing(clone, server, new, had, partial, versions[-1])
