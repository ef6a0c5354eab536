"""theta.git.repo.remember_reads: the filter's config and directory reads answered from one snapshot give
what the one-process-per-read functions give (real git), and a config write forgets the snapshot."""
import subprocess

import pytest

from theta.git import repo


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "global"))
    r = tmp_path / "r"
    subprocess.run(["git", "init", "-q", str(r)], check=True)
    with open(r / ".git" / "config", "a") as f:
        f.write('[foo]\n\tflag\n[Sub "MiXed"]\n\tKeY = 1\n\tkey = 2\n[theta]\n\tlevel = 3\n\trtol = 1e-4\n'
                '[lfs]\n\tstorage = elsewhere\n')
    yield r
    repo._forget()


KEYS = ["foo.flag", "sub.MiXed.key", "Sub.MiXed.KEY", "sub.mixed.key", "theta.level", "lfs.storage",
        "core.hooksPath", "nothing.here"]


def test_snapshot_answers_as_git_does(git_repo):
    direct = {k: repo.config_get(k, git_repo) for k in KEYS}
    regexp = repo.config_get_regexp(r"^theta\.", git_repo)
    dirs = (repo.common_dir(git_repo), repo.hooks_dir(git_repo))
    assert direct["sub.MiXed.key"] == "2" and direct["sub.mixed.key"] is None and direct["foo.flag"] == ""
    repo.remember_reads(git_repo)
    assert {k: repo.config_get(k, git_repo) for k in KEYS} == direct
    assert repo.config_get_regexp(r"^theta\.", git_repo) == regexp == {"theta.level": "3", "theta.rtol": "1e-4"}
    assert (repo.common_dir(git_repo), repo.hooks_dir(git_repo)) == dirs


def test_a_config_write_forgets_the_snapshot(git_repo):
    repo.remember_reads(git_repo)
    repo.config_set("theta.level", "5", git_repo, scope="local")
    assert repo.config_get("theta.level", git_repo) == "5"


def test_another_directory_is_not_answered_from_the_snapshot(git_repo, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    repo.remember_reads(git_repo)
    assert repo.config_get("theta.level", other) is None
    assert repo.common_dir(other) == (other / ".git").resolve()
