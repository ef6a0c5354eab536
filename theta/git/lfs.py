"""git-lfs subprocesses: fetch and push LFS objects named by oid, whatever refers to them.

Our blobs are plain LFS objects in git-lfs's local store, but git's trees hold theta metadata rather than
LFS pointer files, so git-lfs cannot find them by itself. Two small bridges:

- **fetch** (:class:`Fetch`, :func:`fetch_objects`): write one LFS pointer per object into a *throwaway*
  object directory, make a tree and a commit of them there, and run one ``git lfs fetch <remote> <commit>``
  with that directory as ``GIT_OBJECT_DIRECTORY`` (the real object database is an alternate). git-lfs finds
  the pointers, asks the server for all of them in batch requests and downloads them concurrently
  (``lfs.concurrenttransfers``) into the real LFS store, in the order the pointers are named. Nothing is
  added to the repository's object database.
- **push** (:func:`push_objects`): ``git lfs push --object-id <remote> --stdin``; the batch API uploads only
  the objects the server lacks.
- **verify** (:func:`fetched_elsewhere`): the same fetch into a throwaway repository that shares no object
  store with ours, to prove what the remote holds (`git theta prune --verify-remote`).

The storage layer (:mod:`theta.storage.transfer`) decides which objects to move.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from theta.base.errors import TransferError
from theta.git import repo as gitutil

POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def pointer_text(oid: str, size: int) -> bytes:
    return POINTER.format(oid=oid, size=size).encode()


def local_remote_objects(repo_dir: str | os.PathLike, remote: str) -> Path | None:
    """The LFS object directory of ``remote`` when git-lfs moves objects to it by copying files (a file://
    URL or a path, no LFS server configured: git-lfs's standalone transfer, which reports no byte progress);
    None for a remote behind an LFS server."""
    if gitutil.config_get(f"remote.{remote}.lfsurl", repo_dir) or gitutil.config_get("lfs.url", repo_dir):
        return None
    url = gitutil.run_text(["remote", "get-url", remote], repo_dir, check=False)
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url or (":" in url.split("/", 1)[0] and not url.startswith("/")):
        return None  # http(s), ssh (URL or scp-like host:path)
    path = Path(url) if os.path.isabs(url) else (Path(repo_dir) / url)
    if (path / ".git").is_dir():
        return path / ".git" / "lfs" / "objects"  # a non-bare repository
    return path / "lfs" / "objects" if path.is_dir() else None


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


def fetch_objects(repo_dir: str | os.PathLike, remote: str, objects: Iterable[tuple[str, int]]) -> str | None:
    """Run one ``git lfs fetch`` of ``objects`` ((oid, size) pairs) from ``remote`` into the local LFS store.

    Returns git-lfs's last stderr line when it failed, else None; the caller checks what arrived.
    """
    with Fetch(repo_dir, remote, objects) as run:
        return run.wait()


class Fetch:
    """One ``git lfs fetch`` of ``objects`` ((oid, size) pairs) from ``remote`` into the local LFS store,
    running in the background from :meth:`start` (or entering the ``with`` block) until :meth:`wait`.

    git-lfs walks the pointers of a tree in the order of their names and downloads them batch after batch
    (100 objects each), ``lfs.concurrenttransfers`` at a time: the pointers are named by their position in
    ``objects``, so each batch holds the next objects in the order given (a caller rebuilding files as their
    blobs arrive lists them in the order it needs them). Within a batch git-lfs starts the largest first, and
    a batch starts once the one before has ended. A download cut short stays in ``lfs/incomplete``, where the
    next run resumes it (with an HTTP range request, when the server honours one): git-lfs keeps a download cut
    short by an error as ``<oid>.part``, and one cut short by a kill is made so before the run starts
    (:func:`adopt_partials`).
    """

    def __init__(self, repo_dir: str | os.PathLike, remote: str, objects: Iterable[tuple[str, int]],
                 lfs_dir: str | os.PathLike | None = None):
        self.repo_dir, self.remote, self.objects = repo_dir, remote, list(objects)
        self.lfs_dir = Path(lfs_dir) if lfs_dir is not None else None  # the LFS store's directory, if known
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        self._err = None  # git-lfs's stderr (a temp file: a pipe nobody reads while it runs could fill)

    def start(self) -> "Fetch":
        if self.lfs_dir is not None:
            adopt_partials(self.lfs_dir, {oid for oid, _ in self.objects})
        real_objects = Path(gitutil.run_text(["rev-parse", "--git-path", "objects"], self.repo_dir))
        if not real_objects.is_absolute():
            real_objects = (Path(self.repo_dir) / real_objects).resolve()
        self._tmp = tempfile.TemporaryDirectory(prefix="fetch-", dir=gitutil.scratch_dir(self.repo_dir))
        tmp = self._tmp.name
        env = dict(os.environ)
        alternates = [str(real_objects)] + [a for a in env.get("GIT_ALTERNATE_OBJECT_DIRECTORIES", "").split(":") if a]
        env["GIT_OBJECT_DIRECTORY"] = tmp
        env["GIT_ALTERNATE_OBJECT_DIRECTORIES"] = ":".join(alternates)
        width = len(str(len(self.objects)))
        entries = []
        for i, (oid, size) in enumerate(self.objects):
            sha = _write_loose_blob(Path(tmp), pointer_text(oid, size))
            entries.append(f"100644 blob {sha}\t{i:0{width}d}-{oid}\n")
        tree = _git_env(["mktree"], self.repo_dir, env, "".join(entries).encode()).strip()
        commit = _git_env(["commit-tree", "-m", "theta fetch", tree], self.repo_dir,
                          {**env, "GIT_AUTHOR_NAME": "theta", "GIT_AUTHOR_EMAIL": "theta@localhost",
                           "GIT_COMMITTER_NAME": "theta", "GIT_COMMITTER_EMAIL": "theta@localhost"}).strip()
        self._err = tempfile.TemporaryFile()
        # -I/-X "" clear any lfs.fetchinclude/fetchexclude: our synthetic paths must all be fetched.
        self._proc = subprocess.Popen(["git", "lfs", "fetch", "-I", "", "-X", "", self.remote, commit],
                                      cwd=self.repo_dir, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self._err)
        return self

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait(self) -> str | None:
        """Wait for git-lfs to end; its last stderr line when it failed, else None."""
        if self._proc is None:
            return None
        code = self._proc.wait()
        if code == 0:
            return None
        self._err.seek(0)
        err = self._err.read().decode("utf-8", "replace").strip().splitlines()
        return err[-1] if err else f"git lfs fetch exited with {code}"

    def stop(self) -> None:
        """End git-lfs now (what it downloaded so far stays: complete objects in the store, the rest in
        ``lfs/incomplete`` for the next run to resume)."""
        if self.running():
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def close(self) -> None:
        self.stop()
        if self._err is not None:
            self._err.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Fetch":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def adopt_partials(lfs_dir: str | os.PathLike, oids: set[str]) -> int:
    """Make the partial downloads of ``oids`` that a killed git-lfs left behind resumable; how many were.

    git-lfs (3.x) downloads an object into ``lfs/incomplete/<oid><random digits>`` and, when the download
    fails, renames it ``<oid>.part``, which the next run moves back and resumes from its last byte. A process
    killed outright (kill -9, a machine going down) renames nothing: its partial file keeps its random name and
    is never resumed. Such a file -- one no process has open (Linux's /proc says; where it cannot tell, nothing is
    done) and not empty -- becomes ``<oid>.part`` when there is none; other leftovers of the same object go.
    """
    incomplete = Path(lfs_dir) / "incomplete"
    try:
        names = os.listdir(incomplete)
    except OSError:
        return 0
    orphans: dict[str, list[Path]] = {}
    for name in names:
        oid, rest = name[:64], name[64:]
        if oid in oids and rest.isdigit():
            orphans.setdefault(oid, []).append(incomplete / name)
    if not orphans:
        return 0
    held = _open_files(incomplete)
    if held is None:
        return 0
    adopted = 0
    for oid, paths in orphans.items():
        free = [(p, _size(p)) for p in paths if os.path.realpath(p) not in held]
        free = [(p, n) for p, n in free if n is not None]
        part = incomplete / f"{oid}.part"
        if not free or part.exists():
            continue
        best, size = max(free, key=lambda pn: pn[1])
        if size > 0:
            try:
                os.rename(best, part)
                adopted += 1
            except OSError:
                continue
        for p, _ in free:
            if p != best or size == 0:
                with contextlib.suppress(OSError):
                    os.unlink(p)
    return adopted


def _size(p: Path) -> int | None:
    try:
        return p.stat().st_size
    except OSError:
        return None


def _open_files(directory: Path) -> set[str] | None:
    """The paths in ``directory`` some process has open (from /proc/<pid>/fd), or None when that cannot be
    known here."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    prefix = os.path.realpath(directory) + os.sep
    held: set[str] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to look at
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith(prefix):
                held.add(target)
    return held


# the repository config a download from the remote depends on (its URL, LFS endpoint, HTTP and credentials)
_REMOTE_CONFIG = r"^(remote|lfs|http|url|credential)\."


@contextlib.contextmanager
def fetched_elsewhere(repo_dir: str | os.PathLike, remote: str,
                      objects: Iterable[tuple[str, int]]) -> Iterator[tuple[Path, str | None]]:
    """Download ``objects`` from ``remote`` into a throwaway repository that shares nothing local with
    ``repo_dir``; yields (its LFS objects directory, git-lfs's error line or None), removed on exit.

    For proving what the remote holds: git-lfs copies an object from any local *reference* store (the
    ``lfs/objects`` beside each git alternate, e.g. our own store when it is an alternate) instead of
    downloading it, so the scratch repository has no alternates, its own LFS store, and of ``repo_dir``'s
    local config only what reaching the remote needs (remote, lfs, http, url, credential keys).
    """
    objects = list(objects)
    with tempfile.TemporaryDirectory(prefix="verify-", dir=gitutil.theta_dir(repo_dir)) as tmp:
        scratch = Path(tmp) / "scratch.git"
        env = {k: v for k, v in os.environ.items()
               if k not in ("GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_INDEX_FILE",
                            "GIT_WORK_TREE", "GIT_COMMON_DIR")}
        env["GIT_DIR"] = str(scratch)
        _git_env(["init", "-q", "--bare", str(scratch)], repo_dir, env)
        listing = subprocess.run(["git", "config", "--local", "-z", "--get-regexp", _REMOTE_CONFIG], cwd=repo_dir,
                                 capture_output=True).stdout.decode("utf-8", "surrogateescape")
        for item in filter(None, listing.split("\0")):
            key, _, value = item.partition("\n")
            if key != "lfs.storage":
                _git_env(["config", "--add", key, value], repo_dir, env)
        entries = [f"100644 blob {_write_loose_blob(scratch / 'objects', pointer_text(oid, size))}\t{oid}\n"
                   for oid, size in objects]
        tree = _git_env(["mktree"], repo_dir, env, "".join(entries).encode()).strip()
        commit = _git_env(["commit-tree", "-m", "theta verify", tree], repo_dir,
                          {**env, "GIT_AUTHOR_NAME": "theta", "GIT_AUTHOR_EMAIL": "theta@localhost",
                           "GIT_COMMITTER_NAME": "theta", "GIT_COMMITTER_EMAIL": "theta@localhost"}).strip()
        proc = subprocess.run(["git", "lfs", "fetch", "-I", "", "-X", "", remote, commit], cwd=repo_dir, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True)
        err = None
        if proc.returncode != 0:
            lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            err = lines[-1] if lines else f"git lfs fetch exited with {proc.returncode}"
        yield scratch / "lfs" / "objects", err


def _git_env(args: list[str], cwd, env: dict, input: bytes | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, input=input, capture_output=True)
    if proc.returncode != 0:
        raise TransferError(f"git {args[0]}: {proc.stderr.decode('utf-8', 'replace').strip()}")
    return proc.stdout.decode()


def push_objects(repo_dir: str | os.PathLike, remote: str, oids: Iterable[str],
                 progress_file: str | os.PathLike | None = None) -> None:
    """Upload the LFS objects ``oids`` to ``remote``'s LFS server (the server skips those it has).

    ``progress_file``: git-lfs appends a line per transfer update to it (``GIT_LFS_PROGRESS``, git-lfs(1):
    ``<direction> <i>/<n files> <bytes so far>/<object bytes> <name>``), for a caller's progress bar."""
    env = None
    if progress_file is not None:
        env = {**os.environ, "GIT_LFS_PROGRESS": os.fspath(progress_file)}
    proc = subprocess.run(["git", "lfs", "push", "--object-id", remote, "--stdin"], cwd=repo_dir, env=env,
                          input="".join(o + "\n" for o in oids).encode(), capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise TransferError(f"git lfs push to {remote!r} failed: {err[-1] if err else proc.returncode}")
