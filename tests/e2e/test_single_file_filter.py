"""The single-file filters `git-theta-filter clean PATH` / `smudge PATH`, through real git configured as
Git-Theta's `git theta install` configures it (filter.theta.clean/smudge, no filter.theta.process): the same
bytes as the long-running filter gives for the same input, both directions; stdout carries data alone; and
`git theta install` over that configuration replaces Git-Theta's keys and says so."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from support.gitrepo import GIT_THETA_CONFIG, GitEnv, Repo

import zipslice

PROCESS = ["-c", "filter.theta.process=git-theta filter-process"]  # the long-running filter, for comparison


def torch_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(300, 64, generator=g), "fc.weight": torch.randn(16, 64, generator=g),
            "fc.bias": torch.zeros(16), "steps": torch.tensor(7, dtype=torch.int64)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Repo:
    """A repository whose git runs theta through Git-Theta's global keys only (single-file filters)."""
    base = tmp_path_factory.mktemp("single-file")
    env = GitEnv.create(base)
    for k, v in GIT_THETA_CONFIG.items():
        env.run(["git", "config", "--global", k, v], cwd=base)
    r = env.init("work", theta=False)
    (r / ".gitattributes").write_text("*.pt filter=theta merge=theta diff=theta\n"
                                      "*.safetensors filter=theta merge=theta diff=theta\n")
    r.commit("attributes", ".gitattributes")
    assert "filter.theta.process" not in r.out("config", "--list")
    return r


def hash_both_ways(repo: Repo, path: str) -> tuple[str, str]:
    """The blob id of the work-tree file's clean, by the single-file filter and by the long-running one."""
    single = repo.out("hash-object", "--path", path, path)
    process = repo.git(*PROCESS, "hash-object", "--path", path, path).stdout.decode().strip()
    return single, process


def test_clean_gives_the_long_running_filters_bytes_first_and_incremental(repo):
    torch.save(torch_model(1), repo / "model.pt")
    save_file({"w": np.arange(5000, dtype=np.float32).reshape(50, 100)}, str(repo / "model.safetensors"))
    for path in ("model.pt", "model.safetensors"):
        single, process = hash_both_ways(repo, path)
        assert single == process, path
    repo.commit("v1", "model.pt", "model.safetensors")  # through the single-file clean
    assert repo.out("rev-parse", "HEAD:model.pt") == single_of(repo, "model.pt")
    meta = repo.show("HEAD:model.pt")
    assert meta.startswith(b"theta-metadata ")
    # clean by hand: stdin to stdout, the text git stored
    direct = subprocess.run(["git-theta-filter", "clean", "model.pt"], cwd=repo.path, env=repo.env.env,
                            stdin=open(repo / "model.pt", "rb"), capture_output=True)
    assert direct.returncode == 0 and direct.stdout == meta

    v2 = torch_model(1)
    v2["fc.weight"][3, 5] += 1.0  # a small change: an incremental step against v1's metadata
    torch.save(v2, repo / "model.pt")
    single, process = hash_both_ways(repo, "model.pt")
    assert single == process
    repo.commit("v2", "model.pt")
    assert repo.out("rev-parse", "HEAD:model.pt") == single
    text = repo.show("HEAD:model.pt").decode()
    assert text != meta.decode()


def single_of(repo: Repo, path: str) -> str:
    return repo.out("hash-object", "--path", path, path)


def test_smudge_gives_the_long_running_filters_bytes(repo):
    if "model.pt" not in repo.out("ls-files"):
        pytest.skip("needs the clean test's commits")
    for path in ("model.pt", "model.safetensors"):
        single = repo.git("cat-file", "--filters", f"HEAD:{path}").stdout
        process = repo.git(*PROCESS, "cat-file", "--filters", f"HEAD:{path}").stdout
        assert single == process, path
        assert len(single) > 20_000 and not single.startswith(b"theta-metadata"), path  # the checkpoint itself
        # a checkout through the single-file smudge writes the same bytes
        (repo / path).unlink()
        repo.git("checkout", "--", path)
        assert (repo / path).read_bytes() == single
        # by hand: metadata on stdin, the checkpoint on stdout (Git-Theta's end-to-end suite does this)
        direct = subprocess.run(["git-theta-filter", "smudge", path], cwd=repo.path, env=repo.env.env,
                                input=repo.show(f"HEAD:{path}"), capture_output=True)
        assert direct.returncode == 0 and direct.stdout == single, direct.stderr
    assert repo.status() == ""
    with zipslice.load(repo / "model.pt") as ck:
        want = torch_model(1)
        want["fc.weight"][3, 5] += 1.0
        for k, v in want.items():
            got = np.asarray(ck.numpy(k))
            assert got.dtype == v.numpy().dtype and got.tobytes() == v.numpy().tobytes(), k
    # an earlier version, smudged at HEAD (metadata of v1 on stdin)
    v1 = subprocess.run(["git-theta-filter", "smudge", "model.pt"], cwd=repo.path, env=repo.env.env,
                        input=repo.show("HEAD~1:model.pt"), capture_output=True)
    assert v1.returncode == 0
    assert v1.stdout == repo.git(*PROCESS, "cat-file", "--filters", "HEAD~1:model.pt").stdout


def test_smudge_writes_the_checkpoint_whatever_its_size(repo):
    """The long-running filter hands git a placeholder for a checkpoint above theta.materializeAbove and
    writes the file when git is done; one file per process has no such end, so it writes the checkpoint."""
    if "model.pt" not in repo.out("ls-files"):
        pytest.skip("needs the clean test's commits")
    want = repo.git("cat-file", "--filters", "HEAD:model.pt").stdout
    (repo / "model.pt").unlink()
    repo.git("-c", "theta.materializeAbove=1", "checkout", "--", "model.pt")
    assert (repo / "model.pt").read_bytes() == want


def test_stdout_is_data_alone_and_failures_exit_non_zero(repo):
    bad = subprocess.run(["git-theta-filter", "smudge", "model.pt"], cwd=repo.path, env=repo.env.env,
                         input=b"theta-metadata 3\nnot metadata at all\n", capture_output=True)
    assert bad.returncode == 1 and bad.stdout == b""
    err = bad.stderr.decode()
    assert err.startswith("git-theta-filter: error: smudge model.pt: ") and err.count("\n") == 1, err
    usage = subprocess.run(["git-theta-filter", "clean"], cwd=repo.path, env=repo.env.env, input=b"",
                           capture_output=True)
    assert usage.returncode == 2 and usage.stdout == b"" and b"git's %f" in usage.stderr


def test_install_replaces_git_thetas_keys_and_says_so(tmp_path):
    env = GitEnv.create(tmp_path)
    for k, v in GIT_THETA_CONFIG.items():
        env.run(["git", "config", "--global", k, v], cwd=tmp_path)
    env.run(["git", "config", "--global", "--add", "filter.theta.clean", "git-theta-filter clean %f"], cwd=tmp_path)
    r = env.init("work", theta=False)
    # Git-Theta's `install --scope repository` in this repository: would override the global keys
    for k in ("merge.theta.driver", "diff.theta.command", "filter.theta.smudge"):
        r.git("config", "--local", k, GIT_THETA_CONFIG[k])
    r.git("config", "--local", "theta.keepme", "yes")
    out = r.theta("install").stdout.decode()
    for k in ("filter.theta.clean", "filter.theta.smudge", "merge.theta.driver", "merge.theta.name",
              "diff.theta.command"):
        assert f"replaced Git-Theta's {k} ({GIT_THETA_CONFIG[k]}) with theta's (global)" in out, (k, out)
    for k in ("merge.theta.driver", "diff.theta.command", "filter.theta.smudge"):
        assert f"removed Git-Theta's {k} ({GIT_THETA_CONFIG[k]}) from this repository's config" in out, (k, out)
    assert "filter.theta.required" not in out  # the same value in both: nothing to replace
    merged = r.out("config", "--get-regexp", r"^(filter|merge|diff)\.theta\.")
    for program in ("git-theta-filter", "git-theta-merge", "git-theta-diff"):
        assert program not in merged
    assert len(r.out("config", "--global", "--get-all", "filter.theta.clean").splitlines()) == 1
    assert r.out("config", "--local", "theta.keepme") == "yes"
    # and the repository works through theta's long-running filter
    (r / ".gitattributes").write_text("*.pt filter=theta\n")
    torch.save(torch_model(2), r / "m.pt")
    r.commit("m", ".gitattributes", "m.pt")
    assert r.show("HEAD:m.pt").startswith(b"theta-metadata ")
    assert "Git-Theta" not in r.theta("install").stdout.decode()  # a second run has nothing to replace


LIMIT = 256 << 20  # the cgroup: smaller than the checkpoint (384 MiB), four of its groups (64 MiB each)


@pytest.mark.slow
def test_single_file_filters_stream_in_a_memory_cgroup_smaller_than_the_model(repo, tmp_path):
    """`git-theta-filter clean PATH` and `smudge PATH` by hand, each inside a memory cgroup (page cache counted)
    smaller than the model: both finish without an OOM kill, the checkpoint comes back bit for bit, and the
    smudge's bytes are the long-running filter's. (Like the long-running filter's smudge, it holds a group
    whole while verifying it, and the next one being rebuilt: the bound is groups, not the model.)"""
    from scripts.bench.memcg import MemoryCgroup, Unavailable

    try:
        cg = MemoryCgroup.create(f"gtsuite-single-file-{os.getpid()}", LIMIT)
    except Unavailable as e:
        pytest.skip(f"no memory cgroup here: {e}")
    try:
        g = torch.Generator().manual_seed(5)
        state = {f"layers.{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(6)}
        state["step"] = torch.tensor(3)
        torch.save(state, repo / "big.pt")
        del state
        meta, out = tmp_path / "big.meta", tmp_path / "big-out.pt"
        for command, src, dst in (("clean", repo / "big.pt", meta), ("smudge", meta, out)):
            run = cg.child()
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                proc = subprocess.run(["git-theta-filter", command, "big.pt"], cwd=repo.path, env=repo.env.env,
                                      stdin=fin, stdout=fout, stderr=subprocess.PIPE, preexec_fn=run.join)
            kills = run.oom_kills()
            run.remove(kill=True)
            assert proc.returncode == 0 and kills == 0, (command, proc.stderr.decode()[-2000:])
        assert meta.read_bytes().startswith(b"theta-metadata ")
        want = torch.load(repo / "big.pt")
        got = torch.load(out)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        del want, got
        # the long-running filter's bytes for the same metadata (git holds that output whole: outside the cgroup)
        oid = repo.git("hash-object", "-w", "--no-filters", str(meta)).stdout.decode().strip()
        process = repo.git(*PROCESS, "cat-file", "--filters", "--path=big.pt", oid).stdout
        assert process == out.read_bytes()
    finally:
        (repo / "big.pt").unlink(missing_ok=True)
        cg.remove(kill=True)
