"""`git theta fetch` / `checkout` / `pull`, and placeholders that stay (with one line saying what to run).

Real git, real git-lfs, a file:// remote (git-lfs's standalone file transfer).
"""
from __future__ import annotations

import re
import shutil
from collections import OrderedDict

import pytest

from support.checkpoints import assert_same_checkpoint, blob_oids, make_state, save_pt
from support.gitrepo import GitEnv


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def published(genv):
    """A work repository with two commits of model.pt pushed to a file:// remote; (repo, url, v1, v2)."""
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    url = f"file://{bare.path}"
    repo.git("remote", "add", "origin", url)
    v1 = make_state(3)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v1)
    del v2["embed.weight"]  # a blob only v1 needs (a changed group's chain would still need v1's blob)
    v2["layers.1.mlp.weight"] = v1["layers.1.mlp.weight"] * 2
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    repo.git("push", "-q", "origin", "main")
    return repo, url, v1, v2


def is_placeholder(path) -> bool:
    return path.read_bytes().startswith(b"theta-metadata ")


def test_clone_without_theta_then_install_and_pull(genv):
    repo, url, v1, v2 = published(genv)
    clone = genv.clone(url, "clone")                      # theta not installed globally: no filter runs
    assert is_placeholder(clone / "model.pt")
    assert clone.status() == ""
    genv.run(["git", "theta", "install"], cwd=genv.home)
    out = clone.theta("pull")
    assert "checked out model.pt" in out.stdout.decode()
    assert_same_checkpoint(clone / "model.pt", v2)
    assert clone.status() == ""
    assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt")
    # a second pull has nothing to do
    again = clone.theta("pull")
    assert again.stdout.decode() == ""


def test_skip_smudge_clone_then_pull_from_a_subdirectory(genv):
    genv.run(["git", "theta", "install"], cwd=genv.home)
    repo, url, v1, v2 = published(genv)
    clone_path = genv.home.parent / "clone"
    genv.run(["git", "clone", "-q", url, str(clone_path)], cwd=genv.home, extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    from support.gitrepo import Repo

    clone = Repo(clone_path, genv)
    assert is_placeholder(clone / "model.pt")
    assert clone.lfs_objects() == set()                    # nothing downloaded
    assert clone.status() == ""
    (clone / "sub").mkdir()
    genv.run(["git", "theta", "pull", "../model.pt"], cwd=clone / "sub")
    assert_same_checkpoint(clone / "model.pt", v2)
    assert clone.status() == ""


def test_fetch_downloads_another_revision_without_touching_the_work_tree(genv):
    genv.run(["git", "theta", "install"], cwd=genv.home)
    repo, url, v1, v2 = published(genv)
    clone = genv.clone(url, "clone")
    assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt")
    before = (clone / "model.pt").read_bytes()
    only_v1 = blob_oids(clone, "HEAD~1:model.pt") - blob_oids(clone, "HEAD:model.pt")
    assert only_v1
    out = clone.theta("fetch", "HEAD~1").stdout.decode()
    assert out.startswith(f"fetched {len(only_v1)} of ") and "for 1 checkpoint(s)" in out
    assert clone.lfs_objects() == blob_oids(clone, "HEAD:model.pt") | blob_oids(clone, "HEAD~1:model.pt")
    assert (clone / "model.pt").read_bytes() == before
    # the blobs are local now: checking out v1 works with the remote gone
    clone.git("remote", "remove", "origin")
    clone.git("checkout", "-q", "HEAD~1", extra_env={"GIT_THETA_MATERIALIZE_ABOVE": "0"})
    assert_same_checkpoint(clone / "model.pt", v1)
    assert clone.status() == ""
    bad = clone.theta("fetch", "nope", check=False)
    assert bad.returncode == 1 and "'nope' is not a commit" in bad.stderr.decode()


def test_missing_blobs_leave_a_placeholder_and_say_what_to_run(genv):
    repo = genv.init("work")
    v1 = make_state(4)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v1)
    del v2["embed.weight"]
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    assert blob_oids(repo, "HEAD~1:model.pt") - blob_oids(repo, "HEAD:model.pt")
    store = repo.git_common_dir() / "lfs" / "objects"
    aside = repo.path.parent / "aside"
    shutil.copytree(store, aside)
    keep = repo.git_common_dir() / "lfs" / "theta-objects"  # theta's protected second name (care)
    for oid in blob_oids(repo, "HEAD~1:model.pt") - blob_oids(repo, "HEAD:model.pt"):
        (store / oid[:2] / oid[2:4] / oid).unlink()
        (keep / oid[:2] / oid[2:4] / oid).unlink(missing_ok=True)

    proc = repo.git("checkout", "-q", "HEAD~1", extra_env={"GIT_THETA_MATERIALIZE_ABOVE": "0"}, check=False)
    assert proc.returncode == 1  # the post-checkout hook's status: the checkout could not write the checkpoint
    err = proc.stderr.decode()
    lines = [line for line in err.splitlines() if "placeholder" in line]
    assert len(lines) == 1, err
    assert "model.pt is a placeholder" in lines[0] and "run `git theta checkout model.pt`" in lines[0]
    assert (repo / "model.pt").read_bytes() == repo.show("HEAD:model.pt")
    assert repo.status() == ""
    assert not (repo.git_common_dir() / "index.lock").exists()

    failed = repo.theta("checkout", "model.pt", check=False)
    assert failed.returncode == 1 and "model.pt is a placeholder" in failed.stderr.decode()
    shutil.rmtree(store)
    shutil.copytree(aside, store)
    repo.theta("checkout", "model.pt")
    assert_same_checkpoint(repo / "model.pt", v1)
    assert repo.status() == ""
    nothing = repo.theta("checkout")
    assert "nothing to check out" in nothing.stderr.decode()


def run_in_terminal(args, cwd, env) -> str:
    """Run a command with stdout and stderr on a pseudo-terminal; everything it printed (ANSI codes removed)."""
    import os
    import pty
    import re
    import subprocess

    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=cwd, env={**env, "COLUMNS": "120"}, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait() == 0
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.decode(errors="replace"))


def test_progress_on_a_terminal_names_the_file(genv):
    import torch

    genv.run(["git", "theta", "install"], cwd=genv.home)
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    g = torch.Generator().manual_seed(0)
    torch.save({f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}, repo / "model.pt")  # 24 MiB
    repo.commit("v1", ".gitattributes", "model.pt")
    repo.git("push", "-q", "origin", "main")
    out = run_in_terminal(["git", "clone", "-q", f"file://{bare.path}", "clone"], genv.home.parent, genv.env)
    assert "theta fetch model.pt" in out                  # the LFS download, under the file's name
    assert "24.0/24.0 MiB" in out                          # the checkpoint written, bytes and total
    assert "theta smudge model.pt" in out
    # not a terminal: nothing but what git prints
    quiet = genv.run(["git", "clone", "-q", f"file://{bare.path}", "clone2"], cwd=genv.home.parent)
    assert "theta" not in quiet.stderr.decode().replace("git-theta: installed", "")


def test_git_archive_gets_the_checkpoint_not_a_placeholder(genv):
    import io
    import tarfile

    repo = genv.init("work")
    v1 = make_state(6)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    out = repo.git("archive", "--format=tar", "HEAD", "model.pt", extra_env={"GIT_THETA_MATERIALIZE_ABOVE": "0"})
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        data = tar.extractfile("model.pt").read()
    ref = repo.path.parent / "ref" / "model.pt"
    ref.parent.mkdir()
    repo.theta("export", "HEAD:model.pt", str(ref))
    assert data == ref.read_bytes()
    shown = repo.git("cat-file", "--filters", "HEAD:model.pt", extra_env={"GIT_THETA_MATERIALIZE_ABOVE": "0"})
    assert shown.stdout == ref.read_bytes()
    assert repo.status() == ""


def _bar_totals(out: str, label: str) -> list[tuple[str, str]]:
    """(done, total) of every frame of the bar labelled ``label`` in a terminal's output."""
    return re.findall(re.escape(label) + r"[^\n\r]*?(\d+\.\d)/(\d+\.\d) MiB", out)


def test_checkout_push_and_theta_pull_show_progress_on_a_terminal(genv):
    """Every long step names the file and shows bytes (rich's bar: done/total and rate) on a terminal: a
    checkout's materialization, a push's LFS upload, `git theta pull`'s LFS download and checkout."""
    import torch

    genv.run(["git", "theta", "install"], cwd=genv.home)
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    g = torch.Generator().manual_seed(0)
    for v in (1, 2):
        torch.save({f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}, repo / "model.pt")  # 24 MiB
        repo.commit(f"v{v}", ".gitattributes", "model.pt")

    pushed = run_in_terminal(["git", "push", "-q", "origin", "main"], repo.path, genv.env)
    frames = _bar_totals(pushed, "theta push model.pt")
    assert frames, pushed
    done, total = frames[-1]
    assert done == total and float(total) > 20, frames  # every byte of both versions' blobs, seen arriving

    out = run_in_terminal(["git", "checkout", "-q", "HEAD~1"], repo.path, genv.env)
    assert ("24.0", "24.0") in _bar_totals(out, "theta smudge model.pt"), out
    assert re.search(r"\d+\.\d [KMG]i?B/s", out), out  # the rate (the bar advanced group by group)

    clone = genv.home.parent / "lazy"
    genv.run(["git", "clone", "-q", f"file://{bare.path}", str(clone)], cwd=genv.home.parent,
             extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    assert is_placeholder(clone / "model.pt")
    out = run_in_terminal(["git", "theta", "pull"], clone, genv.env)
    fetched = _bar_totals(out, "theta fetch model.pt")
    assert fetched and fetched[-1][0] == fetched[-1][1], out  # the LFS download, under the file's name
    assert ("24.0", "24.0") in _bar_totals(out, "theta smudge model.pt"), out
    assert not is_placeholder(clone / "model.pt")
