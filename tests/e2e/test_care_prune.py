"""Nothing needed is ever pruned: the real `git lfs prune` (every variant) and `git theta prune`, in a
repository with an unpushed branch, unpushed commits, two stash entries, a second worktree with its own
commits and staged version, a staged version in the main worktree, a commit only the reflog holds, an
orphan blob, and a plain git-lfs file beside the checkpoints; remote: giftless on 127.0.0.1.

After each prune every version still needed is rebuilt bit for bit *with the LFS server stopped* (so
nothing could have been fetched back), and `git theta fsck` passes offline.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from scripts.bench.lfs_server import GiftlessServer
from support.checkpoints import assert_same_checkpoint, blob_oids, make_state, save_pt
from support.gitrepo import GitEnv, Repo

from theta.storage.metadata import loads
from theta.storage.store import KEEP_DIR, BlobRef, LfsStore

pytestmark = pytest.mark.lfs_server


def version(i: int) -> OrderedDict:
    """Version i of the model: one group replaced by fresh values (a new dense blob no other version has)."""
    sd = make_state(1, n_layers=1)
    g = torch.Generator().manual_seed(1000 + i)
    sd["layers.0.mlp.weight"] = torch.randn(64, 32, generator=g)
    return sd


def keep_oids(repo: Repo) -> set[str]:
    d = repo.git_common_dir() / "lfs" / KEEP_DIR
    return {p.name for p in d.glob("??/??/*") if p.is_file()}


def lost(repo: Repo, oids: set[str]) -> list[str]:
    """The needed oids that are gone or damaged (under either name); empty when all are intact."""
    store = LfsStore.for_repo(repo.path)
    missing = []
    for oid in oids:
        keep, lfs = store.keep_path(oid), store.path(oid)
        if not (keep.exists() or lfs.exists()):
            missing.append(oid)
            continue
        data = (lfs if lfs.exists() else keep).read_bytes()
        if hashlib.sha256(data).hexdigest() != oid:
            missing.append(oid)
    return missing


class Scenario:
    """The repository state of the module docstring; ``specs`` maps each needed state to (repo, spec, sd)."""

    def __init__(self, tmp_path: Path, server: GiftlessServer):
        genv = self.genv = GitEnv.create(tmp_path)
        repo = self.repo = genv.init("work")
        bare = genv.init("remote.git", theta=False, bare=True)
        repo.git("remote", "add", "origin", str(bare.path))
        repo.git("config", "lfs.url", server.lfs_url("org", "model"))
        repo.git("lfs", "track", "*.bin")
        self.v = {i: version(i) for i in range(1, 12)}
        m = "model.pt"

        def save(i):
            save_pt(repo / m, self.v[i])

        save(1)
        (repo / "data.bin").write_bytes(b"plain lfs v1\n" * 100)
        repo.commit("v1", ".gitattributes", m, "data.bin")
        save(2)
        (repo / "data.bin").write_bytes(b"plain lfs v2\n" * 100)
        repo.commit("v2", m, "data.bin")
        repo.git("push", "-q", "-u", "origin", "main")                  # v1, v2 on the remote
        repo.git("checkout", "-q", "-b", "exp")
        save(3)
        repo.commit("v3 on an unpushed branch", m)
        repo.git("checkout", "-q", "main")
        save(4)
        repo.commit("v4 unpushed on main", m)
        save(5)
        repo.git("stash", "-q")                                         # stash@{1} after the next one
        save(6)
        repo.git("stash", "-q")                                         # stash@{0}
        repo.git("checkout", "-q", "-b", "tmp")
        save(10)
        repo.commit("v10, soon only in the reflog", m)
        self.v10_commit = repo.out("rev-parse", "HEAD")
        repo.git("checkout", "-q", "main")
        repo.git("branch", "-q", "-D", "tmp")
        save(11)
        repo.git("add", m)
        orphan_refs = {r.oid: r.size for r in loads(repo.show(":model.pt")).blob_refs()}
        repo.git("reset", "-q", m)                                      # v11: stored, then unstaged: orphan
        save(9)
        repo.git("add", m)                                              # v9 staged in the main worktree
        wt2 = genv.home.parent / "wt2"
        repo.git("worktree", "add", "-q", "-b", "side", str(wt2), "main")
        self.wt2 = Repo(wt2, genv)
        save_pt(wt2 / m, self.v[7])
        self.wt2.commit("v7 in the second worktree", m)
        save_pt(wt2 / m, self.v[8])
        self.wt2.git("add", m)                                          # v8 staged in the second worktree
        self.specs = {
            "origin/main (v2)": (repo, "origin/main:model.pt", self.v[2]),
            "exp, unpushed branch (v3)": (repo, "exp:model.pt", self.v[3]),
            "main, unpushed commit (v4)": (repo, "main:model.pt", self.v[4]),
            "stash@{1} (v5)": (repo, "stash@{1}:model.pt", self.v[5]),
            "stash@{0} (v6)": (repo, "stash@{0}:model.pt", self.v[6]),
            "second worktree's branch (v7)": (self.wt2, "side:model.pt", self.v[7]),
            "second worktree's index (v8)": (self.wt2, ":model.pt", self.v[8]),
            "main worktree's index (v9)": (repo, ":model.pt", self.v[9]),
            "reflog only (v10)": (repo, f"{self.v10_commit}:model.pt", self.v[10]),
        }
        self.needed = set().union(*(blob_oids(r, spec) for r, spec, _ in self.specs.values()))
        v1_refs = {r.oid: r.size for r in loads(repo.show("main~2:model.pt")).blob_refs()}
        self.pushed_only = {o: n for o, n in v1_refs.items() if o not in self.needed}  # v1's own blobs
        self.orphan = {o: n for o, n in orphan_refs.items() if o not in self.needed and o not in v1_refs}
        assert self.pushed_only and self.orphan

    def rebuild_all(self, tmp: Path, monkeypatch) -> None:
        """Rebuild every needed version from the local store (in this process: `git theta export`'s own
        function, so no CLI start-up per version; git runs in the scenario's environment)."""
        from theta.commands.export import export

        with monkeypatch.context() as mp:
            for k in [k for k in os.environ if k.startswith("GIT_")]:
                mp.delenv(k)
            for k, v in self.genv.env.items():
                mp.setenv(k, v)
            for i, (label, (r, spec, sd)) in enumerate(self.specs.items()):
                out = tmp / f"out{i}.pt"
                export(spec, out, cwd=r.path, progress=False)
                assert_same_checkpoint(out, sd)
                out.unlink()


@pytest.fixture
def server(tmp_path):
    with GiftlessServer(tmp_path / "lfs-store") as s:
        yield s


def test_nothing_needed_is_pruned_by_git_lfs_or_theta(tmp_path, server, monkeypatch):
    sc = Scenario(tmp_path, server)
    repo = sc.repo
    before = keep_oids(repo)
    assert sc.needed <= before and set(sc.orphan) <= before and set(sc.pushed_only) <= before
    lfs_data = blob_oids_of_pointer(repo, "main:data.bin")

    # 1. the real `git lfs prune` (and `git lfs fetch --prune`), every way a user may run it: it deletes
    #    git-lfs's names of theta's blobs (it cannot see theta's metadata) and nothing needed is lost
    for args in ((), ("--verify-remote",), ("--force",), ("--recent",), ("fetch", "--prune")):
        proc = repo.git("lfs", *args) if args[:1] == ("fetch",) else repo.git("lfs", "prune", *args)
        assert proc.returncode == 0
        assert not lost(repo, sc.needed), args
        assert keep_oids(repo) == before, args
        if not args:
            assert lfs_data <= repo.lfs_objects()  # git-lfs keeps its own pointer's object (HEAD) by default
    assert not (sc.needed & repo.lfs_objects())  # git-lfs did delete its names of them: the keep saved them

    server.stop()
    sc.rebuild_all(tmp_path, monkeypatch)
    assert repo.theta("fsck").returncode == 0
    server.start()

    repo.git("lfs", "fetch", "origin", "main")  # `--force` pruned data.bin's object (pushed): back for step 4
    assert lfs_data <= repo.lfs_objects()

    # 2. git theta prune --dry-run: lists, deletes nothing
    out = repo.theta("prune", "--dry-run", "--json").stdout
    dry = json.loads(out)
    assert set(dry["deleted"]) == set(sc.pushed_only) | set(sc.orphan) and dry["dry_run"]
    assert keep_oids(repo) == before

    # 3. --verify-remote: v1's blobs come back from the server -> deleted; the orphan was never pushed -> kept.
    #    Both under git-lfs's name too: git-lfs copies from a local store it can see instead of downloading,
    #    and a verification must not be fooled by that
    store = LfsStore.for_repo(repo.path)
    for oid, size in {**sc.orphan, **sc.pushed_only}.items():
        assert store.has(BlobRef(oid, size)) and store.path(oid).exists()
    rep = json.loads(repo.theta("prune", "--verify-remote", "--json").stdout)
    assert set(rep["deleted"]) == set(sc.pushed_only)
    assert set(rep["unverified"]) == set(sc.orphan)
    assert rep["freed"] == sum(sc.pushed_only.values())
    assert keep_oids(repo) == before - set(sc.pushed_only)

    # 4. plain prune: the orphan goes; bytes freed reported exactly
    text = repo.theta("prune", "--verbose").stdout.decode()
    assert f"deleted {len(sc.orphan)}, freed" in text and f"({sum(sc.orphan.values())} bytes)" in text, text
    assert keep_oids(repo) == before - set(sc.pushed_only) - set(sc.orphan)
    assert lfs_data <= repo.lfs_objects()  # theta never touches git-lfs's own objects

    # 5. offline again: every needed version rebuilds, fsck passes, git lfs prune still harmless
    repo.git("lfs", "prune", "--force")
    server.stop()
    sc.rebuild_all(tmp_path, monkeypatch)
    assert repo.theta("fsck").returncode == 0
    server.start()
    # v1 was pruned locally but the remote has it: a checkout of it fetches it back
    out = tmp_path / "v1.pt"
    repo.theta("export", "main~2:model.pt", str(out))
    assert_same_checkpoint(out, sc.v[1])


@pytest.mark.slow
def test_without_the_protected_name_git_lfs_prune_loses_every_theta_blob(tmp_path, server):
    """The table of docs/guide/repository-care.md (run with -s to print it): the scenario with theta's
    protected name removed, then each way of running the real `git lfs prune`."""
    sc = Scenario(tmp_path, server)
    repo = sc.repo
    shutil.rmtree(repo.git_common_dir() / "lfs" / KEEP_DIR)
    rows = [("before", len(repo.lfs_objects()), len(sc.needed) - len(lost(repo, sc.needed)))]
    for args in ((), ("--verify-remote",), ("--force",)):
        repo.git("lfs", "prune", *args)
        rows.append((" ".join(("`git lfs prune", *args)) + "`", len(repo.lfs_objects()),
                     len(sc.needed) - len(lost(repo, sc.needed))))
    print("\n| step | lfs/objects | needed theta blobs intact |\n|---|---:|---:|")
    for step, objects, intact in rows:
        print(f"| {step} | {objects} | {intact} / {len(sc.needed)} |")
    assert rows[0][2] == len(sc.needed) and rows[1][2] == 0  # git-lfs cannot see theta's metadata


def blob_oids_of_pointer(repo: Repo, spec: str) -> set[str]:
    text = repo.show(spec).decode()
    return {line.split(":", 1)[1] for line in text.splitlines() if line.startswith("oid sha256:")}
