"""Every row of the command table in docs/guide/migrating-from-git-theta.md: each Git-Theta 0.2.0 subcommand
and option (its argparse surface: install; track FILE; add FILE [--update-type T] [--update-data PATH] [git add
args]; post-commit; pre-push REMOTE URL; the drivers git-theta-filter/-merge/-diff its `install` configures;
its GIT_THETA_* environment) run against theta through real git: it works the same or says what to use.
(--update-type/--update-data/--update-path with data: tests/e2e/test_git_theta_repos.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import zipslice
from support.gitrepo import GIT_THETA_CONFIG, GitEnv, Repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Repo:
    """A Git-Theta user's setup (its global config), then theta's `git theta install` over it."""
    base = tmp_path_factory.mktemp("gt-commands")
    env = GitEnv.create(base)
    for k, v in GIT_THETA_CONFIG.items():
        env.run(["git", "config", "--global", k, v], cwd=base)
    env.run(["git", "theta", "install"], cwd=base)  # row: git theta install (global, as Git-Theta's)
    r = env.init("work", theta=False, track=())
    return r


def test_install_replaces_git_theta_drivers(repo):
    cfg = repo.out("config", "--global", "--get-regexp", r"^(filter|merge|diff)\.theta\.")
    assert "git-theta-filter" not in cfg and "git-theta-merge" not in cfg and "git-theta-diff" not in cfg
    assert "filter.theta.process" in cfg and "filter.theta.required true" in cfg


def test_track_writes_git_thetas_attribute_line(repo):
    repo.theta("track", "model.pt")
    lines = [line.split() for line in (repo / ".gitattributes").read_text().splitlines()]
    # Git-Theta writes "model.pt filter=theta merge=theta diff=theta": the same attributes
    assert ["model.pt", "diff=theta", "filter=theta", "merge=theta"] in [[ln[0], *sorted(ln[1:])] for ln in lines]
    repo.git("add", ".gitattributes")


def test_add_passes_git_add_arguments_and_checkpoint_type_is_noted(repo):
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, repo / "model.pt")
    proc = repo.theta("add", "model.pt", "--checkpoint-type", "pytorch", "--verbose")  # --verbose: a git add arg
    assert "--checkpoint-type pytorch is not needed" in proc.stderr.decode()
    assert "add 'model.pt'" in proc.stdout.decode()
    repo.git("commit", "-q", "-m", "base")
    assert repo.show("HEAD:model.pt").startswith(b"theta-metadata 3\n")


def test_update_data_path_environment_is_read(repo):
    """GIT_THETA_UPDATE_TYPE + GIT_THETA_UPDATE_DATA_PATH (Git-Theta's names) with a plain `git add`."""
    with zipslice.load(repo / "model.pt") as ck:
        w = np.array(ck.numpy("w"))
    scale = np.array([[2.0], [0.5]], np.float32)
    torch.save({"w/ia3": torch.from_numpy(scale)}, repo / "u.bin")
    torch.save({"w": torch.from_numpy(w * scale)}, repo / "model.pt")  # theta's current form
    repo.git("add", "model.pt", extra_env={"GIT_THETA_UPDATE_TYPE": "ia3",
                                           "GIT_THETA_UPDATE_DATA_PATH": str(repo / "u.bin")})
    repo.git("commit", "-q", "-m", "ia3")
    assert '"type":"ia3"' in repo.show("HEAD:model.pt").decode()
    (repo / "u.bin").unlink()


def test_hooks_post_commit_says_why_and_pre_push_runs(repo):
    proc = repo.theta("post-commit")
    assert proc.returncode == 0 and "theta needs no post-commit hook" in proc.stderr.decode()
    assert repo.theta("pre-push", "origin", "file:///nowhere").returncode == 0  # nothing pushed: no-op


def test_unknown_update_type_is_refused_naming_the_choices(repo):
    proc = repo.theta("add", "model.pt", "--update-type", "lora-x", "--update-data", "model.pt", check=False)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "--update-type 'lora-x': expected one of auto, " in err and "low-rank" in err and "ia3" in err
