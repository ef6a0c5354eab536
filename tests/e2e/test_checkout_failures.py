"""A checkout that cannot produce the model fails, says why, and is completed by running it again -- real git.

A checkpoint above theta.materializeAbove reaches the work tree as a placeholder that theta replaces once git is
done (theta.commands.materialize); these tests make that step fail -- the writer killed with SIGKILL at several
points (GIT_THETA_FAULT), a full disk, an out-of-memory kill in a memory cgroup, a hostile metadata text refused
while rebuilt -- and check, each time: the command's exit status (non-zero for checkout, switch, restore and
clone: theta's post-checkout hook; 0 with a line on stderr for reset --hard, whose hook git ignores), the line
naming the file, the reason and the command that completes the work, a clean `git status` with the placeholder
(never refused content under the real name), no lock or temp file, `git theta status` exiting 1 with the reason
in --json; then the same git command again, which writes the checkpoint bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import numpy as np
import pytest
import torch
from scripts.bench.memcg import MemoryCgroup
from support.crafted import Attacker, leftovers, meta_text, step, value_hash, victim_clone
from support.gitrepo import GitEnv, Repo

KILLED = "the process writing it was killed before it finished"


@pytest.fixture
def genv(tmp_path):
    env = GitEnv.create(tmp_path)
    env.run(["git", "theta", "install"], cwd=env.home)  # global, so a clone's checkout runs theta
    return env


def model(seed: int, mib: int = 2) -> dict:
    """A checkpoint above the default theta.materializeAbove (1 MiB): the placeholder path, default settings."""
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(mib << 17, 2, generator=g), "head.bias": torch.randn(64, generator=g)}


def history(repo: Repo, name: str = "model.pt") -> tuple[dict, dict]:
    """v1 (tagged v1, branch old) and v2 (main)."""
    v1, v2 = model(1), model(2)
    torch.save(v1, repo / name)
    repo.commit("v1", ".gitattributes", name)
    repo.git("tag", "v1")
    repo.git("branch", "old")
    torch.save(v2, repo / name)
    repo.commit("v2", name)
    return v1, v2


def theta_status(repo: Repo) -> tuple[int, dict]:
    res = repo.theta("status", "--json", check=False)
    return res.returncode, json.loads(res.stdout)


def assert_left_as_placeholder(repo: Repo, res, path: str, why: str, rev: str = "HEAD") -> None:
    """The failed command's aftermath: the placeholder of ``rev``'s version under the real name, a clean status,
    the line on stderr, no lock or temp file, and `git theta status` saying why with exit status 1."""
    err = res.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if f"git-theta: {path} is a placeholder (" in line]
    assert len(lines) == 1 and why in lines[0] and lines[0].endswith(f"; run `git theta checkout {path}`"), err
    assert "Traceback" not in err, err
    assert (repo / path).read_bytes() == repo.show(f"{rev}:{path}")
    assert repo.status() == ""
    assert not (repo.git_common_dir() / "index.lock").exists()
    assert leftovers(repo) == [] and not any((repo.git_common_dir() / "theta").glob("materialize-*"))
    assert not [p for p in repo.path.rglob(".*.theta-*") if ".git" not in p.parts]
    code, doc = theta_status(repo)
    assert code == 1 and [p["path"] for p in doc["placeholders"]] == [path], doc
    assert why in doc["placeholders"][0]["why"]


def assert_materialized(repo: Repo, path: str, state: dict) -> None:
    got = torch.load(repo / path, weights_only=True)
    assert list(got) == list(state) and all(torch.equal(got[k], v) for k, v in state.items())
    assert repo.status() == ""
    code, doc = theta_status(repo)
    assert code == 0 and doc["placeholders"] == []
    assert not any((repo.git_common_dir() / "theta").glob("materialize-*"))


# (the command that fails, what it left: the version checked out, its exit status is git's or 0)
COMMANDS = {
    "checkout": (["checkout", "-q", "v1"], "v1", True),
    "switch": (["switch", "-q", "old"], "old", True),
    "restore": (["restore", "model.pt"], "HEAD", True),
    "reset --hard": (["reset", "-q", "--hard", "v1"], "v1", False),
}


@pytest.mark.parametrize("point", ["smudge:group", pytest.param("smudge:group:2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_killed_writer_fails_the_command_and_the_same_command_completes_it(genv, command, point):
    repo = genv.init("work")
    v1, v2 = history(repo)
    args, rev, fails = COMMANDS[command]
    if command == "restore":
        (repo / "model.pt").write_bytes(b"scribbled over")
    res = repo.git(*args, check=False, extra_env={"GIT_THETA_FAULT": point})
    assert (res.returncode != 0) == fails, res.stderr
    assert_left_as_placeholder(repo, res, "model.pt", "the process writing it was killed", rev)
    again = repo.git(*args)  # the same command, nothing else: git leaves the placeholder, theta's hook writes it
    assert again.returncode == 0
    assert_materialized(repo, "model.pt", v2 if rev == "HEAD" else v1)


def test_a_clone_whose_checkout_is_killed_fails_and_a_checkout_completes_it(genv):
    repo = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    _, v2 = history(repo)
    repo.git("push", "-q", "origin", "main")
    dest = genv.home.parent / "clone"
    res = genv.run(["git", "clone", "-q", f"file://{bare.path}", str(dest)], cwd=genv.home, check=False,
                   extra_env={"GIT_THETA_FAULT": "smudge:group"})
    assert res.returncode != 0
    clone = Repo(dest, genv)
    assert_left_as_placeholder(clone, res, "model.pt", KILLED)
    clone.git("checkout", "-q", "main")
    assert_materialized(clone, "model.pt", v2)


def test_a_kill_after_the_swap_leaves_the_checkpoint_and_fails_the_checkout(genv):
    """Killed between putting the checkpoint in place and recording it in the index: the file is whole, the
    command still fails (it did not finish), and `git theta status` finds nothing wrong."""
    repo = genv.init("work")
    v1, _ = history(repo)
    res = repo.git("checkout", "-q", "v1", check=False, extra_env={"GIT_THETA_FAULT": "materialize:swapped"})
    assert res.returncode != 0 and KILLED in res.stderr.decode()
    assert torch.equal(torch.load(repo / "model.pt", weights_only=True)["embed.weight"], v1["embed.weight"])
    repo.git("checkout", "-q", "v1")
    assert_materialized(repo, "model.pt", v1)


# -- a full disk ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of its own (root only)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small file system of its own: mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_a_full_disk_fails_the_checkout_and_the_same_checkout_completes_it(genv, small_disk, name):
    from safetensors.torch import load_file, save_file

    repo_path = small_disk / "work"
    genv.run(["git", "init", "-q", str(repo_path)], cwd=genv.home)
    repo = Repo(repo_path, genv)
    repo.theta("install", "--local")
    repo.theta("track", name)
    v1, v2 = model(1, mib=3), model(2, mib=3)
    for message, state in (("v1", v1), ("v2", v2)):
        torch.save(state, repo / name) if name.endswith(".pt") else save_file(state, str(repo / name))
        repo.commit(message, ".gitattributes", name)
    repo.git("tag", "v1", "HEAD~1")
    # the work tree holds a placeholder already, so the checkout below frees no space by replacing the checkpoint
    (repo / name).unlink()
    repo.git("checkout", "--", name, extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - (2 << 20)))  # 2 MiB left: less than the 3 MiB checkpoint
    res = repo.git("checkout", "-q", "v1", check=False)
    assert res.returncode != 0
    assert_left_as_placeholder(repo, res, name, "No space left on device")
    filler.unlink()
    repo.git("checkout", "-q", "v1")
    got = torch.load(repo / name, weights_only=True) if name.endswith(".pt") else load_file(str(repo / name))
    assert all(torch.equal(got[k], v) for k, v in v1.items())
    code, _ = theta_status(repo)
    assert code == 0 and repo.status() == ""


# -- out of memory ---------------------------------------------------------------------------------------------
def test_an_out_of_memory_kill_is_named_and_the_same_checkout_completes_it(genv):
    """The writer killed by the kernel for want of memory in its cgroup (a limit that holds git and theta's idle
    filter, not the writer besides): the checkout fails and the line says so; the same checkout with room
    completes it. The limit is tried from a few values (what the processes take varies by machine)."""
    repo = genv.init("work")
    g = torch.Generator().manual_seed(3)
    v1 = {f"w{i}": torch.randn(12 << 20, generator=g) for i in range(2)}  # 48 MiB groups
    torch.save(v1, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = {k: v + 1 for k, v in v1.items()}  # a delta on v1: rebuilt from a chain
    torch.save(v2, repo / "model.pt")
    repo.commit("v2", "model.pt")
    repo.git("checkout", "-q", "HEAD~1")
    if (reason := MemoryCgroup.unavailable_reason()) is not None:
        pytest.skip(f"no memory cgroup can be made here: {reason}")
    for mib in (64, 56, 72):
        cg = MemoryCgroup.create(f"theta-oom-{os.getpid()}-{mib}", mib << 20)
        try:
            proc = subprocess.run(["git", "checkout", "-q", "main"], cwd=repo.path, env=genv.env,
                                  capture_output=True, preexec_fn=cg.join, timeout=300)
            killed = cg.oom_kills() > 0
        finally:
            cg.remove(kill=True)
        if killed and proc.returncode != 0:
            break
        repo.git("checkout", "-q", "-f", "HEAD~1")
        repo.theta("checkout", check=False)
    else:
        pytest.fail("no limit tried made the kernel kill the writer alone")
    assert_left_as_placeholder(repo, proc, "model.pt", "killed for want of memory (an out-of-memory kill", "main")
    repo.git("checkout", "-q", "main")
    assert_materialized(repo, "model.pt", v2)


# -- refused content -------------------------------------------------------------------------------------------
def test_metadata_refused_while_rebuilt_fails_the_clone_and_fails_again_loudly(genv):
    """A hostile text that parses but is refused while the checkpoint is rebuilt (an unknown step type): the
    clone exits non-zero naming the file, the group and the problem; the refused content is never under the real
    name; running the checkout again fails again, with the reason."""
    evil = Attacker.create(genv)
    w = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: the placeholder path under default settings
    g = evil.dense("w", w)
    g["steps"].append(step("evil", evil.blob({"x": w}), value_hash(w)))
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    res, clone = victim_clone(genv, evil.url, "clone")
    assert not res.timed_out and not res.oom_killed
    assert res.returncode != 0, res.err
    why = "unknown update type 'evil'"
    assert_left_as_placeholder(clone, res, "model.pt", f"group 'w': step 1", "HEAD")
    assert why in res.err
    again = clone.git("checkout", "-q", "main", check=False)
    assert again.returncode != 0 and why in again.stderr.decode() and "model.pt is a placeholder" in again.stderr.decode()
    assert clone.status() == "" and (clone / "model.pt").read_bytes() == clone.show("HEAD:model.pt")
    code, doc = theta_status(clone)
    assert code == 1 and why in doc["placeholders"][0]["why"]
