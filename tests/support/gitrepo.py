"""Test helpers: isolated git environments and repositories driven by the real git and git-lfs.

    env = GitEnv.create(tmp_path)            # own HOME and global config; user.name/email set
    repo = env.init("work", theta=True)      # git init + git theta install --local + track
    repo.git("add", "model.pt"); repo.commit("msg")

Nothing here touches the user's configuration: HOME, GIT_CONFIG_GLOBAL and XDG_CONFIG_HOME point into tmp.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
GIT_THETA_CONFIG = {  # what Git-Theta 0.2.0's `git theta install` writes to the global config
    "filter.theta.clean": "git-theta-filter clean %f", "filter.theta.smudge": "git-theta-filter smudge %f",
    "filter.theta.required": "true", "merge.theta.name": "Merge Models with Git-Theta",
    "merge.theta.driver": "git-theta-merge %O %A %B %P", "diff.theta.command": "git-theta-diff",
}


def _theta_bin_dir() -> str:
    """The interpreter's own bin directory (where pip put git-theta), ahead of wrappers such as pyenv shims,
    which cost ~0.4 s per git command."""
    own = Path(sys.executable).parent
    if (own / "git-theta").exists():
        return str(own)
    exe = shutil.which("git-theta")
    return str(Path(exe).parent) if exe else str(own)


@dataclass
class GitEnv:
    home: Path
    env: dict
    # run in each child before exec, e.g. scripts.bench.memcg.MemoryCgroup.join: every command in a memory cgroup
    preexec: Callable[[], None] | None = None

    @classmethod
    def create(cls, base: Path) -> "GitEnv":
        home = Path(base) / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "THETA_"))}
        env.update({
            "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
            # (no empty entry: it would put each command's working directory on git-theta's sys.path)
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        })
        # `git theta install` writes no man page beside the interpreter's bin directory (shared, outside tmp);
        # tests/install checks the pages in environments of its own
        env["GIT_THETA_MAN_DIR"] = ""
        env["PATH"] = _theta_bin_dir() + os.pathsep + env.get("PATH", "")
        self = cls(home, env)
        for k, v in {"user.name": "Theta Test", "user.email": "theta@example.com",
                     "init.defaultBranch": "main", "advice.detachedHead": "false"}.items():
            self.run(["git", "config", "--global", k, v], cwd=home)
        return self

    def run(self, args, cwd, input: bytes | None = None, check: bool = True,
            extra_env: dict | None = None) -> subprocess.CompletedProcess:
        env = {**self.env, **(extra_env or {})}
        proc = subprocess.run(args, cwd=cwd, env=env, input=input, capture_output=True, timeout=600,
                              preexec_fn=self.preexec)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}) in {cwd}:\n"
                                 f"stdout: {proc.stdout.decode(errors='replace')}\n"
                                 f"stderr: {proc.stderr.decode(errors='replace')}")
        return proc

    def init(self, name: str, theta: bool = True, track: tuple[str, ...] = ("*.pt", "*.safetensors", "*.h5"),
             bare: bool = False) -> "Repo":
        path = self.home.parent / name
        self.run(["git", "init", "-q", *(["--bare"] if bare else []), str(path)], cwd=self.home)
        repo = Repo(path, self)
        if theta and not bare:
            repo.theta("install", "--local")
            if track:
                repo.theta("track", *track)
        return repo

    def clone(self, url: str, name: str, *args: str) -> "Repo":
        path = self.home.parent / name
        self.run(["git", "clone", "-q", *args, url, str(path)], cwd=self.home)
        return Repo(path, self)


@dataclass
class Repo:
    path: Path
    env: GitEnv

    def git(self, *args: str, input: bytes | None = None, check: bool = True,
            extra_env: dict | None = None) -> subprocess.CompletedProcess:
        return self.env.run(["git", *args], cwd=self.path, input=input, check=check, extra_env=extra_env)

    def out(self, *args: str) -> str:
        return self.git(*args).stdout.decode().strip()

    def theta(self, *args: str, check: bool = True, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        return self.env.run(["git", "theta", *args], cwd=self.path, check=check, extra_env=extra_env)

    def commit(self, message: str, *paths: str) -> str:
        if paths:
            self.git("add", *paths)
        self.git("commit", "-q", "-m", message)
        return self.out("rev-parse", "HEAD")

    def status(self) -> str:
        return self.out("status", "--porcelain")

    def show(self, spec: str) -> bytes:
        return self.git("cat-file", "blob", spec).stdout

    def lfs_objects(self) -> set[str]:
        """The oids in this repository's local LFS store."""
        d = self.git_common_dir() / "lfs" / "objects"
        return {p.name for p in d.glob("??/??/*") if p.is_file() and len(p.name) == 64}

    def lfs_object(self, oid: str) -> Path:
        """Where this repository's local LFS store keeps object ``oid``."""
        return self.git_common_dir() / "lfs" / "objects" / oid[:2] / oid[2:4] / oid

    def git_common_dir(self) -> Path:
        d = Path(self.out("rev-parse", "--git-common-dir"))
        return d if d.is_absolute() else (self.path / d).resolve()

    def __truediv__(self, other: str) -> Path:
        return self.path / other


def bare_lfs_objects(bare: Path) -> set[str]:
    """The oids a file:// remote holds (git-lfs's standalone file transfer stores them under lfs/objects)."""
    return {p.name for p in (Path(bare) / "lfs" / "objects").glob("??/??/*") if p.is_file()}


def clone_bundle(base: Path, fixture: Path) -> Repo:
    """A clone (with theta installed globally) of a bare remote made from a fixture's ``repo.bundle``; the
    remote holds the fixture's LFS objects (``lfs/objects``), which git-lfs downloads during checkout."""
    env = GitEnv.create(base)
    env.run(["git", "theta", "install"], cwd=base)
    origin = base / "origin.git"
    env.run(["git", "clone", "-q", "--bare", str(fixture / "repo.bundle"), str(origin)], cwd=base)
    shutil.copytree(fixture / "lfs" / "objects", origin / "lfs" / "objects")
    return env.clone(f"file://{origin}", "clone")
