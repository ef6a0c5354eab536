"""`git theta fsck` with real git, git-lfs and giftless: a flipped byte, a missing blob, a chain that does
not rebuild to its recorded hash; `--repair` refetches what the remote has and says what it cannot fix."""
from __future__ import annotations

import json
import subprocess
from collections import OrderedDict
from dataclasses import replace

import pytest
from scripts.bench.lfs_server import GiftlessServer
from support.checkpoints import assert_same_checkpoint, make_state, save_pt
from support.gitrepo import GitEnv, Repo

from theta.storage.metadata import dumps, loads
from theta.storage.store import QUARANTINE_DIR, LfsStore, sha256_file

pytestmark = pytest.mark.lfs_server
CHANGED = "model/layers.0.mlp.weight"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """main: v1, then v2 stored as a delta on v1 (a two-step chain for one group), pushed to giftless.
    Built once; each test works on its own copy of the repository (the remote is only read)."""
    tmp = tmp_path_factory.mktemp("fsck")
    with GiftlessServer(tmp / "lfs-store") as server:
        genv = GitEnv.create(tmp)
        repo = genv.init("work")
        bare = genv.init("remote.git", theta=False, bare=True)
        repo.git("remote", "add", "origin", str(bare.path))
        repo.git("config", "lfs.url", server.lfs_url("org", "fsck"))
        v1 = make_state(3, n_layers=1)
        save_pt(repo / "model.pt", v1)
        repo.commit("v1", ".gitattributes", "model.pt")
        v2 = OrderedDict(v1)
        v2["layers.0.mlp.weight"] = v1["layers.0.mlp.weight"] + 0.5
        save_pt(repo / "model.pt", v2)
        repo.theta("add", "model.pt", "--update-type", "delta")
        repo.commit("v2 as a delta")
        repo.git("push", "-q", "-u", "origin", "main")
        yield repo, server, v2


@pytest.fixture
def setup(template, tmp_path):
    repo, server, v2 = template
    copy = tmp_path / "work"
    subprocess.run(["cp", "-a", str(repo.path), str(copy)], check=True)  # -a keeps theta's hard links
    return Repo(copy, repo.env), server, v2


def fsck(repo, *args):
    proc = repo.theta("fsck", "--json", *args, check=False)
    return proc.returncode, json.loads(proc.stdout)


def test_clean_repository_passes(setup):
    repo, _, _ = setup
    meta = loads(repo.show("HEAD:model.pt"))
    assert [s.type for s in meta.groups[CHANGED].steps] == ["dense", "delta"]
    code, rep = fsck(repo)
    assert code == 0 and rep["ok"] and rep["problems"] == []
    # default scope: local refs' tips, the index, local-only history: HEAD's version (v1 is pushed history)
    assert rep["files"] == 1 and rep["blobs"] == len(meta.blob_refs())
    assert rep["bytes"] == sum(r.size for r in meta.blob_refs())
    code, rep = fsck(repo, "HEAD~1", "HEAD")
    assert code == 0 and rep["files"] == 2
    proc = repo.theta("fsck")
    assert proc.returncode == 0 and "OK" in proc.stderr.decode()
    code, rep = fsck(repo, "--pointers")
    assert code == 0 and rep["blobs"] == 0


def test_flipped_byte_is_named_and_repaired(setup):
    repo, _, v2 = setup
    meta = loads(repo.show("HEAD:model.pt"))
    ref = meta.groups[CHANGED].steps[1].blob  # the delta blob
    store = LfsStore.for_repo(repo.path)
    p = store.path(ref)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))  # same inode: theta's protected name sees the same flipped byte
    code, rep = fsck(repo)
    assert code == 1 and not rep["ok"]
    [prob] = rep["problems"]
    assert (prob["kind"], prob["file"], prob["group"], prob["oid"]) == ("corrupt", "model.pt", CHANGED, ref.oid)
    assert "HEAD" in prob["where"] and "main" in prob["where"] and "index" in prob["where"]
    text = repo.theta("fsck", check=False).stdout.decode()
    [line] = text.splitlines()
    assert line.startswith(f"corrupt: blob {ref.oid} (") and f"needed by model.pt group {CHANGED!r} (" in line

    code, rep = fsck(repo, "--repair")
    assert code == 0 and rep["ok"] and rep["repaired"] == 1 and rep["problems"][0]["repaired"]
    assert sha256_file(store.path(ref)) == ref.oid and sha256_file(store.keep_path(ref)) == ref.oid
    quarantined = list((store.objects_dir.parent / QUARANTINE_DIR).iterdir())
    assert [q.name for q in quarantined] == [ref.oid] and quarantined[0].read_bytes() == bytes(data)
    assert fsck(repo)[0] == 0
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", v2)


def test_missing_blob_is_named_and_refetched(setup):
    repo, _, _ = setup
    meta = loads(repo.show("HEAD:model.pt"))
    ref = meta.groups["model/embed.weight"].steps[0].blob
    store = LfsStore.for_repo(repo.path)
    assert store.remove(ref) == ref.size
    code, rep = fsck(repo)
    assert code == 1
    [prob] = rep["problems"]
    assert (prob["kind"], prob["group"], prob["oid"], prob["size"]) == ("missing", "model/embed.weight", ref.oid,
                                                                         ref.size)
    code, rep = fsck(repo, "--repair")
    assert code == 0 and rep["repaired"] == 1
    assert store.has(ref) and sha256_file(store.keep_path(ref)) == ref.oid


def test_missing_blob_the_remote_lacks_is_not_repaired(setup, tmp_path):
    repo, server, _ = setup
    sd = make_state(9, n_layers=1)
    save_pt(repo / "other.pt", sd)
    repo.commit("unpushed model", "other.pt")  # its blobs exist only here
    ref = loads(repo.show("HEAD:other.pt")).groups["model/embed.weight"].steps[0].blob
    LfsStore.for_repo(repo.path).remove(ref)
    code, rep = fsck(repo, "--repair")
    assert code == 1 and not rep["ok"]
    [prob] = [p for p in rep["problems"] if not p["repaired"]]
    assert prob["kind"] == "missing" and prob["file"] == "other.pt" and "not repaired" in prob["detail"]
    assert "main" in prob["where"]


def test_broken_chain_is_reported_and_not_repairable(setup):
    """Every blob intact, but the chain's first step names another group's blob (of the same shape): it
    decodes and applies, and the value it rebuilds is not the one the metadata recorded."""
    repo, _, _ = setup
    meta = loads(repo.show("HEAD:model.pt"))
    other = meta.groups["model/embed.weight"].steps[0]          # 64 x 32 too
    group = meta.groups[CHANGED]
    assert group.shape == meta.groups["model/embed.weight"].shape
    group.steps[0] = replace(group.steps[0], blob=other.blob)
    text = dumps(meta).encode()
    sha = repo.git("hash-object", "-w", "--stdin", input=text).stdout.decode().strip()
    repo.git("update-index", "--cacheinfo", f"100644,{sha},model.pt")
    code, rep = fsck(repo)
    assert code == 1
    [prob] = rep["problems"]
    assert prob["kind"] == "chain" and prob["group"] == CHANGED and prob["where"] == "index"
    assert "hash differs" in prob["detail"]
    code, rep = fsck(repo, "--repair")  # nothing to refetch: the metadata itself is wrong
    assert code == 1 and not rep["problems"][0]["repaired"]
    # the committed version is fine: fsck of a revision checks only that revision
    code, rep = fsck(repo, "HEAD")
    assert code == 0 and rep["problems"] == []


def test_unreadable_metadata_is_a_problem(setup):
    repo, _, _ = setup
    text = repo.show("HEAD:model.pt").replace(b'"order"', b'"ordre"')
    sha = repo.git("hash-object", "-w", "--stdin", input=text).stdout.decode().strip()
    repo.git("update-index", "--cacheinfo", f"100644,{sha},model.pt")
    code, rep = fsck(repo, "--pointers")
    assert code == 1 and rep["problems"][0]["kind"] == "metadata" and rep["problems"][0]["file"] == "model.pt"
    # and prune refuses: what that text needs is unknown
    proc = repo.theta("prune", "--dry-run", check=False)
    assert proc.returncode == 1 and "cannot tell which blobs it needs" in proc.stderr.decode()


def test_bad_revision_is_a_clear_error(setup):
    repo, _, _ = setup
    proc = repo.theta("fsck", "no-such-branch", check=False)
    assert proc.returncode == 1 and "no-such-branch" in proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()
