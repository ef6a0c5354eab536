"""A Llama-shaped sharded safetensors checkpoint whose largest tensor is several times the memory cgroup every
process runs in, through every git command -- real git, git-lfs, a file:// remote.

The model (scripts/bench/llama_model.py, the benchmark's generator): Hugging Face sharded safetensors, bfloat16,
tracked with ``git theta track 'model/*.safetensors'``; its history: base, a full fine-tune, a partial change
(the last 256 rows of the embedding, the last layer), another fine-tune of base on a branch (merged with a
numeric strategy), a change of layer 0's MLP on a branch (rebased, cherry-picked). After every command the work
tree equals bit for bit what was committed (the generated version's file, or for a merge `git theta export` of
the merge's result), `git status` is clean, no lock is left, and the kernel killed nothing.

The default run: a tied 768 MiB embedding (Llama-3.2-1B's layout, scaled down) in a 256 MiB cgroup. The slow
run: the full Llama-3-8B shapes (two 1.0 GB tensors, 3.85 GB) in 1 GiB, as scripts/bench/llama.py measures it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from scripts.bench import llama_model as lm
from scripts.bench.memcg import MemoryCgroup, Unavailable
from support.gitrepo import GitEnv, Repo

SMALL = lm.Dims(hidden=1024, intermediate=2816, kv=256, vocab=393216, layers=2, tied=True)
# the embedding is 768 MiB: 2x the limit. The heaviest step is git stash: its filter waits while update-index's
# own filter cleans the changed shard against a three-step chain, beside git and a hook
SMALL_LIMIT = 384 << 20
FULL_LIMIT = 1 << 30        # two 1.0 GB tensors, 3.85 GB in all
SHARDS = tuple(f"model/{s}" for s in lm.SHARDS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("llama-data")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class History:
    """The versions (written once per module) and the checks against them."""

    def __init__(self, data: Path, dims: lm.Dims):
        self.data, self.dims = data, dims
        self.digests: dict[str, dict[str, str]] = {}

    def dir(self, version: str) -> Path:
        return lm.write_version(self.data, version, self.dims)

    def digest(self, version: str) -> dict[str, str]:
        if version not in self.digests:
            d = self.dir(version)
            self.digests[version] = {f"model/{n}": sha256(d / n) for n in (*lm.SHARDS, lm.INDEX)}
        return self.digests[version]

    def put(self, repo: Repo, version: str, *paths: str) -> None:
        d = self.dir(version)
        (repo / "model").mkdir(exist_ok=True)
        for p in paths or (*SHARDS, f"model/{lm.INDEX}"):
            shutil.copyfile(d / Path(p).name, repo / p)

    def check(self, repo: Repo, version: str | None, cg: MemoryCgroup | None, modified: tuple = ()) -> None:
        """Bit for bit ``version`` (None: the commit's own, by `git theta export`), the status, no lock, no kill."""
        want = self.digest(version) if version else self.exported(repo)
        for path, digest in want.items():
            with open(repo / path, "rb") as f:
                assert f.read(15) != b"theta-metadata ", f"{path} is a placeholder"
            assert sha256(repo / path) == digest, f"{path} differs from {version or 'the commit'}"
        assert sorted(line.split(None, 1)[1] for line in repo.status().splitlines()) == sorted(modified)
        assert not (repo.git_common_dir() / "index.lock").exists()
        if cg is not None:
            assert cg.oom_kills() == 0

    def exported(self, repo: Repo) -> dict[str, str]:
        """The commit's shards as `git theta export` writes them (run without the limit: the reference, not what
        is tested), and its index JSON."""
        out = repo.path.parent / "export"
        out.mkdir(exist_ok=True)
        digests = {f"model/{lm.INDEX}": hashlib.sha256(repo.show(f"HEAD:model/{lm.INDEX}")).hexdigest()}
        joined, repo.env.preexec = repo.env.preexec, None
        try:
            for path in SHARDS:
                target = out / Path(path).name
                repo.theta("export", f"HEAD:{path}", str(target))
                digests[path] = sha256(target)
                target.unlink()
        finally:
            repo.env.preexec = joined
        return digests


def run_history(tmp_path: Path, data: Path, dims: lm.Dims, limit: int) -> None:
    try:
        cg = MemoryCgroup.create(f"theta-llama-{os.getpid()}", limit)
    except Unavailable as e:
        pytest.skip(f"no memory cgroup can be made here ({e}): the point is the limit")
    h = History(data, dims)
    try:
        genv = GitEnv.create(tmp_path)
        genv.run(["git", "theta", "install"], cwd=genv.home)  # global: the clone's checkout runs theta
        repo = genv.init("work", track=("model/*.safetensors",))
        bare = genv.init("remote.git", theta=False, bare=True)
        repo.git("remote", "add", "origin", f"file://{bare.path}")
        for version in ("base", "finetune2", "side", "rebased", "finetune", "partial"):
            h.dir(version)  # written before any limited command (the generator is not what is measured)
        genv.preexec = cg.join  # every git command below, and everything it starts, in the cgroup

        for version in ("base", "finetune", "partial"):     # add + commit: full, full fine-tune, partial
            h.put(repo, version)
            repo.commit(version, ".gitattributes", "model")
            h.check(repo, version, cg)
        repo.git("branch", "ft2", "HEAD~2")
        repo.git("branch", "side", "HEAD~1")
        repo.git("checkout", "-q", "HEAD~1")                 # checkout of a commit
        h.check(repo, "finetune", cg)
        repo.git("switch", "-q", "main")                     # switch
        h.check(repo, "partial", cg)
        repo.git("reset", "-q", "--hard", "HEAD~2")          # reset --hard, there and back
        h.check(repo, "base", cg)
        repo.git("reset", "-q", "--hard", "ORIG_HEAD")
        h.check(repo, "partial", cg)
        h.put(repo, "finetune2", SHARDS[0])                  # stash / pop of a modified shard
        repo.git("stash", "-q")
        h.check(repo, "partial", cg)
        repo.git("stash", "pop", "-q")
        mixed = {**h.digest("partial"), SHARDS[0]: h.digest("finetune2")[SHARDS[0]]}
        h.digests["stashed"] = mixed
        h.check(repo, "stashed", cg, modified=(SHARDS[0],))
        repo.git("restore", "model")                         # restore
        h.check(repo, "partial", cg)

        repo.git("switch", "-q", "ft2")                      # branches made with the limit on too
        h.put(repo, "finetune2")
        repo.commit("finetune2", "model")
        repo.git("switch", "-q", "side")
        h.check(repo, "finetune", cg)
        h.put(repo, "side")
        repo.commit("side", "model")
        repo.git("switch", "-q", "main")
        h.check(repo, "partial", cg)

        repo.git("merge", "-q", "--no-edit", "ft2", extra_env={"GIT_THETA_MERGE_STRATEGY": "average"})
        h.check(repo, None, cg)                              # a numeric merge of every group: export equals
        repo.git("reset", "-q", "--hard", "HEAD~1")
        h.check(repo, "partial", cg)

        repo.git("switch", "-q", "side")                     # rebase: disjoint groups, no numeric work
        repo.git("rebase", "-q", "main")
        h.check(repo, "rebased", cg)
        repo.git("switch", "-q", "main")
        h.check(repo, "partial", cg)

        repo.git("push", "-q", "origin", "main", "side")     # push, clone
        clone = genv.clone(f"file://{bare.path}", "clone")
        h.check(clone, "partial", cg)
        repo.git("cherry-pick", "side")                      # cherry-pick, then pull it (fast-forward)
        h.check(repo, "rebased", cg)
        repo.git("push", "-q", "origin", "main")
        clone.git("pull", "-q", "--ff-only", "origin", "main")
        h.check(clone, "rebased", cg)
        assert cg.peak() <= limit
    finally:
        cg.remove(kill=True)


@pytest.mark.slow  # (3 min: six versions of a 1.5 GB model; test_bigger_than_ram bounds the default run)
def test_llama_shaped_model_several_times_the_limit_through_every_command(tmp_path, data):
    run_history(tmp_path, data, SMALL, SMALL_LIMIT)


@pytest.mark.slow
def test_llama_3_8b_shapes_in_one_gib(tmp_path, data):
    run_history(tmp_path, data, lm.LLAMA3_8B_4L, FULL_LIMIT)
