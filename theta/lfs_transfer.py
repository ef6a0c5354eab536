"""Moving theta's blobs to and from an LFS server through the git-lfs client (so any LFS server works).

Our blobs are plain LFS objects in git-lfs's local store, but git's trees hold theta metadata rather than
LFS pointer files, so git-lfs cannot find them by itself. Two small bridges:

- **fetch** (:func:`fetch_missing`): write one LFS pointer per missing blob into a *throwaway* object
  directory, make a tree and a commit of them there, and run one ``git lfs fetch <remote> <commit>`` with
  that directory as ``GIT_OBJECT_DIRECTORY`` (the real object database is an alternate). git-lfs finds the
  pointers, asks the server for all of them in batch requests and downloads them concurrently into the
  real LFS store. Nothing is added to the repository's object database. One git-lfs process per checkout
  of a file, however many groups it has.
- **push** (:func:`push_objects`): ``git lfs push --object-id <remote> --stdin``; the batch API uploads only
  the objects the server lacks.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import zlib
import hashlib
from pathlib import Path
from typing import Iterable

from . import gitutil
from .errors import ThetaError
from .store import BlobRef, LfsStore

POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


class TransferError(ThetaError):
    """Blobs could not be uploaded to or downloaded from the LFS server."""


def pointer_text(ref: BlobRef) -> bytes:
    return POINTER.format(oid=ref.oid, size=ref.size).encode()


def default_remote(cwd=None) -> str | None:
    """The remote git-lfs would use: lfs.remote.autodetect aside, the branch's remote, then origin, then the only one."""
    remotes = gitutil.run_text(["remote"], cwd, check=False).split()
    if not remotes:
        return None
    branch = gitutil.run_text(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd, check=False)
    if branch:
        upstream = gitutil.config_get(f"branch.{branch}.remote", cwd)
        if upstream and upstream in remotes:
            return upstream
    for name in (gitutil.config_get("remote.lfsdefault", cwd), "origin"):
        if name and name in remotes:
            return name
    return remotes[0] if len(remotes) == 1 else None


def _write_loose_blob(objects_dir: Path, data: bytes) -> str:
    """Write a loose git blob object (zlib of "blob <len>\\0<data>") and return its sha1."""
    raw = b"blob %d\0" % len(data) + data
    sha = hashlib.sha1(raw).hexdigest()
    d = objects_dir / sha[:2]
    d.mkdir(exist_ok=True)
    (d / sha[2:]).write_bytes(zlib.compress(raw, 1))
    return sha


def fetch_missing(repo_dir: str | os.PathLike, refs: Iterable[BlobRef], remote: str | None = None,
                  store: LfsStore | None = None) -> int:
    """Download every blob of ``refs`` that the local store lacks, all in one git-lfs run.

    Returns how many were downloaded. Raises TransferError naming the missing oids if there is no remote
    or the remote does not have them.
    """
    store = store or LfsStore.for_repo(repo_dir)
    missing = store.missing(refs)
    if not missing:
        return 0
    remote = remote or default_remote(repo_dir)
    if remote is None:
        raise TransferError(f"{len(missing)} blob(s) are missing locally (first: {missing[0].oid}) "
                            "and the repository has no remote to fetch them from")
    real_objects = Path(gitutil.run_text(["rev-parse", "--git-path", "objects"], repo_dir))
    if not real_objects.is_absolute():
        real_objects = (Path(repo_dir) / real_objects).resolve()
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=gitutil.theta_dir(repo_dir)) as tmp:
        env = dict(os.environ)
        alternates = [str(real_objects)] + [a for a in env.get("GIT_ALTERNATE_OBJECT_DIRECTORIES", "").split(":") if a]
        env["GIT_OBJECT_DIRECTORY"] = tmp
        env["GIT_ALTERNATE_OBJECT_DIRECTORIES"] = ":".join(alternates)
        entries = []
        for ref in missing:
            sha = _write_loose_blob(Path(tmp), pointer_text(ref))
            entries.append(f"100644 blob {sha}\t{ref.oid}\n")
        tree = _git_env(["mktree"], repo_dir, env, "".join(entries).encode()).strip()
        commit = _git_env(["commit-tree", "-m", "theta fetch", tree], repo_dir,
                          {**env, "GIT_AUTHOR_NAME": "theta", "GIT_AUTHOR_EMAIL": "theta@localhost",
                           "GIT_COMMITTER_NAME": "theta", "GIT_COMMITTER_EMAIL": "theta@localhost"}).strip()
        # -I/-X "" clear any lfs.fetchinclude/fetchexclude: our synthetic paths must all be fetched.
        proc = subprocess.run(["git", "lfs", "fetch", "-I", "", "-X", "", remote, commit], cwd=repo_dir, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True)
    still = store.missing(missing)
    if proc.returncode != 0 or still:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = f": {err[-1]}" if err else ""
        first = (still or missing)[0].oid
        raise TransferError(f"could not download {len(still) or len(missing)} blob(s) from remote {remote!r} "
                            f"(first: {first}){detail}")
    return len(missing)


def _git_env(args: list[str], cwd, env: dict, input: bytes | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, input=input, capture_output=True)
    if proc.returncode != 0:
        raise TransferError(f"git {args[0]}: {proc.stderr.decode('utf-8', 'replace').strip()}")
    return proc.stdout.decode()


def push_objects(repo_dir: str | os.PathLike, remote: str, refs: Iterable[BlobRef],
                 store: LfsStore | None = None) -> int:
    """Upload ``refs`` to ``remote``'s LFS server (the server skips those it has). Returns how many were offered."""
    store = store or LfsStore.for_repo(repo_dir)
    unique = sorted({r.oid: r for r in refs}.values(), key=lambda r: r.oid)
    if not unique:
        return 0
    absent = store.missing(unique)
    if absent:
        raise TransferError(f"cannot push: {len(absent)} blob(s) referenced by the pushed commits are not in the "
                            f"local LFS store (first: {absent[0].oid}); check out or export those versions "
                            "from a remote that has them first")
    proc = subprocess.run(["git", "lfs", "push", "--object-id", remote, "--stdin"], cwd=repo_dir,
                          input="".join(r.oid + "\n" for r in unique).encode(), capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise TransferError(f"git lfs push to {remote!r} failed: {err[-1] if err else proc.returncode}")
    return len(unique)
