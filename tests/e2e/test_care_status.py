"""`git theta status`, `ls-files --json`, `untrack`, `--version`, `-h`, the metadata hint a collaborator without
theta sees, and the prune refusals — real git and git-lfs."""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict

import pytest
import torch
from support.checkpoints import make_state, save_pt
from support.gitrepo import GitEnv

from theta.storage.metadata import HINT, loads
from theta.storage.store import LfsStore


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def test_status_json_and_text(genv):
    repo = genv.init("work")
    a1, b1, d1 = make_state(1, n_layers=1), make_state(2, n_layers=1), make_state(3, n_layers=1)
    save_pt(repo / "a.pt", a1)
    save_pt(repo / "b.pt", b1)
    save_pt(repo / "d.pt", d1)
    repo.commit("v1", ".gitattributes", "a.pt", "b.pt", "d.pt")
    a2 = OrderedDict(a1)
    a2["embed.weight"] = a1["embed.weight"] + 1          # modified
    a2["extra.bias"] = torch.ones(7)                       # added
    del a2["layers.0.norm.weight"]                        # removed
    save_pt(repo / "a.pt", a2)
    repo.git("add", "a.pt")
    (repo / "b.pt").write_bytes(repo.show(":b.pt"))        # a placeholder: the metadata text itself
    b_meta = loads(repo.show(":b.pt"))
    gone = b_meta.groups["model/embed.weight"].steps[0].blob
    LfsStore.for_repo(repo.path).remove(gone)
    c = make_state(5, n_layers=2)
    save_pt(repo / "c.pt", c)
    repo.git("add", "c.pt")
    (repo / "d.pt").unlink()
    (repo / "notes.txt").write_text("not a checkpoint\n")
    repo.commit("notes", "notes.txt")  # commits the staged a.pt and c.pt too
    # stage a change again so `staged` is non-empty after the commit
    a3 = OrderedDict(a2)
    a3["head.bias"] = torch.ones(64, dtype=torch.bfloat16)
    save_pt(repo / "a.pt", a3)
    repo.git("add", "a.pt")

    res = repo.theta("status", "--json", check=False)
    assert res.returncode == 1  # b.pt holds a placeholder that should be its checkpoint
    doc = json.loads(res.stdout)
    assert [p["path"] for p in doc["placeholders"]] == ["b.pt"]
    assert "metadata text" in doc["placeholders"][0]["why"]
    files = {f["path"]: f for f in doc["files"]}
    assert sorted(files) == ["a.pt", "b.pt", "c.pt", "d.pt"]
    a, b, cc, d = files["a.pt"], files["b.pt"], files["c.pt"], files["d.pt"]
    assert a["state"] == "materialized" and a["format"] == "torch" and a["groups"] == len(a3)
    assert a["size"] == nbytes(a3) and a["worktree_bytes"] == os.path.getsize(repo / "a.pt")
    assert a["staged"] == {"added": 0, "removed": 0, "modified": 1, "new_file": False}
    assert a["blobs_missing"] == 0 and a["blobs_local"] == a["blobs"] > 0
    assert b["state"] == "placeholder" and b["blobs_missing"] == 1 and b["blobs_local"] == b["blobs"] - 1
    assert b["staged"] == {"added": 0, "removed": 0, "modified": 0, "new_file": False}
    assert b["stored"] == sum(r.size for r in b_meta.blob_refs())
    assert cc["state"] == "materialized" and cc["groups"] == len(c) and cc["size"] == nbytes(c)
    assert d["state"] == "absent" and d["worktree_bytes"] is None
    # the staged group counts against HEAD, for the modify/add/remove case
    repo.git("reset", "-q", "--soft", "HEAD~1")
    files = {f["path"]: f for f in json.loads(repo.theta("status", "--json", check=False).stdout)["files"]}
    assert files["a.pt"]["staged"] == {"added": 1, "removed": 1, "modified": 2, "new_file": False}
    assert files["c.pt"]["staged"]["new_file"]

    proc = repo.theta("status", check=False)
    assert proc.returncode == 1
    text, err = proc.stdout.decode(), proc.stderr.decode()
    assert "a.pt  materialized" in text and "staged: 2 modified, 1 added, 1 removed group(s)" in text
    assert "b.pt  placeholder" in text and "(1 missing)" in text and "c.pt  materialized" in text
    assert "staged: new file" in text and "git theta pull" in err and "b.pt is a placeholder (" in err


def test_ls_files_json(genv):
    repo = genv.init("work")
    sd = make_state(6, n_layers=1)
    save_pt(repo / "m.pt", sd)
    repo.commit("v1", ".gitattributes", "m.pt")
    doc = json.loads(repo.theta("ls-files", "--json").stdout)
    [f] = doc["files"]
    meta = loads(repo.show(":m.pt"))
    assert f == {"path": "m.pt", "format": "torch", "groups": len(sd), "size": nbytes(sd),
                 "stored": sum(r.size for r in meta.blob_refs()), "local": True}
    assert json.loads(repo.theta("ls-files", "HEAD", "--json").stdout)["files"] == [f]


def test_track_untrack_version_and_help(genv):
    repo = genv.init("work", track=())
    assert repo.theta("track").stdout == b""
    repo.theta("track", "*.pt", "*.bin")
    listed = repo.theta("track").stdout.decode().split()
    assert listed == ["*.pt", "*.bin"]
    (repo / ".gitattributes").write_text((repo / ".gitattributes").read_text() + "*.txt text\n")
    out = repo.theta("untrack", "*.bin", "*.txt").stdout.decode()
    assert "Untracking *.bin" in out and "Not tracked by theta: *.txt" in out
    assert (repo / ".gitattributes").read_text() == "*.pt filter=theta diff=theta merge=theta\n*.txt text\n"
    assert repo.out("check-attr", "filter", "x.bin") == "x.bin: filter: unspecified"
    from theta.commands.cli import version
    assert repo.theta("--version").stdout.decode().strip() == f"git-theta {version()}"
    assert b"Usage:" in repo.theta("status", "-h").stdout  # through git


def test_dash_h_on_every_command():
    """-h on the app and on each registered command (in process: one CLI start-up instead of one each)."""
    from typer.testing import CliRunner

    from theta.commands import cli

    cli._register_areas()
    names = [c.name or c.callback.__name__.replace("_", "-") for c in cli.app.registered_commands]
    assert {"status", "fsck", "prune", "untrack", "uninstall", "ls-files", "track"} <= set(names)
    runner = CliRunner()
    for args in [["-h"]] + [[n, "-h"] for n in names]:
        res = runner.invoke(cli.app, args)
        assert res.exit_code == 0 and "Usage:" in res.output, (args, res.output)


def test_a_collaborator_without_theta_sees_what_the_file_is(genv, tmp_path):
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    save_pt(repo / "model.pt", make_state(7, n_layers=1))
    repo.commit("v1", ".gitattributes", "model.pt")
    repo.git("push", "-q", "origin", "main")
    plain = GitEnv.create(tmp_path / "other-user")  # no theta anywhere in this user's config
    clone = plain.clone(f"file://{bare.path}", "clone")
    lines = (clone / "model.pt").read_text().splitlines()
    assert lines[0] == "theta-metadata 3" and lines[1] == HINT
    assert "pip install" in lines[1] and "git theta install" in lines[1] and "git theta pull" in lines[1]


def test_metadata_written_before_the_hint_stays_clean(genv):
    """A repository committed by a theta without the hint line: re-cleaning the same checkpoint gives back
    the committed bytes, so `git status` stays clean after upgrading."""
    repo = genv.init("work")
    save_pt(repo / "model.pt", make_state(8, n_layers=1))
    repo.commit("v1", ".gitattributes", "model.pt")
    old_text = repo.show("HEAD:model.pt").replace((HINT + "\n").encode(), b"")
    assert old_text != repo.show("HEAD:model.pt")
    sha = repo.git("hash-object", "-w", "--stdin", input=old_text).stdout.decode().strip()
    repo.git("update-index", "--cacheinfo", f"100644,{sha},model.pt")
    repo.commit("as an older theta wrote it")
    os.utime(repo / "model.pt", (time.time() + 5, time.time() + 5))  # stat-dirty: git must re-clean
    assert repo.status() == ""
    repo.git("add", "model.pt")
    assert repo.show(":model.pt") == old_text


def test_prune_refuses_while_git_writes_an_index_and_on_shared_storage(genv, tmp_path):
    repo = genv.init("work")
    save_pt(repo / "model.pt", make_state(9, n_layers=1))
    repo.commit("v1", ".gitattributes", "model.pt")
    lock = repo.git_common_dir() / "index.lock"
    lock.write_bytes(b"")
    proc = repo.theta("prune", check=False)
    assert proc.returncode == 1 and "index.lock" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()
    lock.unlink()
    repo.git("config", "lfs.storage", str(repo.git_common_dir() / "lfs"))  # same place, but set explicitly
    proc = repo.theta("prune", check=False)
    assert proc.returncode == 1 and "--verify-remote" in proc.stderr.decode()
    assert repo.theta("prune", "--dry-run").returncode == 0


def test_prune_leaves_a_blob_reused_while_it_ran(genv):
    """A candidate touched after the prune planned (as a `git add` re-storing it does) is kept."""
    repo = genv.init("work")
    sd = make_state(10, n_layers=1)
    save_pt(repo / "model.pt", sd)
    repo.git("add", "model.pt")
    staged = loads(repo.show(":model.pt")).blob_refs()
    repo.git("reset", "-q", "model.pt")       # now every blob is an orphan candidate
    store = LfsStore.for_repo(repo.path)
    future = time.time() + 3600
    os.utime(store.keep_path(staged[0]), (future, future))
    rep = json.loads(repo.theta("prune", "--json").stdout)
    assert rep["recent"] == [staged[0].oid]
    assert set(rep["deleted"]) == {r.oid for r in staged[1:]}
    assert store.has(staged[0]) and not any(store.has(r) for r in staged[1:])
