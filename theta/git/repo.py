"""Running git: one place for subprocess calls, config reads, attributes and object reads."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from theta.base import scratch
from theta.base.errors import GitError


def run(args: Sequence[str], cwd: str | os.PathLike | None = None, input: bytes | None = None,
        check: bool = True, env: dict | None = None) -> bytes:
    """Run ``git args`` and return its stdout; raise GitError with git's stderr on failure."""
    proc = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, env=env)
    if check and proc.returncode != 0:
        msg = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = msg[-1] if msg else f"exit status {proc.returncode}"
        raise GitError(f"git {' '.join(args[:3])}: {detail}")
    return proc.stdout


def run_status(args: Sequence[str], cwd=None, input: bytes | None = None, env: dict | None = None) -> int:
    """Run ``git args`` for its exit status only (output discarded)."""
    return subprocess.run(["git", *args], cwd=cwd, input=input, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


def passthrough(args: Sequence[str], cwd=None, env: dict | None = None) -> int:
    """Run ``git args`` with the user's terminal (stdin/stdout/stderr inherited); its exit status."""
    return subprocess.run(["git", *args], cwd=cwd, env=env).returncode


def exec_or_passthrough(args: Sequence[str], env: dict | None = None) -> int:
    """``git args`` in place of this process when it is the ``git-theta`` program on a POSIX system (exec: the
    command's memory, e.g. what a side-loaded add checked, is not held beside git and its filter while they
    run; git's exit status is the command's); otherwise :func:`passthrough` (e.g. called in-process)."""
    if os.name == "posix" and Path(sys.argv[0]).name == "git-theta":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe("git", ["git", *args], env if env is not None else os.environ)
    return passthrough(args, env=env)


def run_text(args: Sequence[str], cwd=None, check: bool = True) -> str:
    return run(args, cwd=cwd, check=check).decode("utf-8").strip()


def in_repository(cwd=None) -> bool:
    return run_status(["rev-parse", "--git-dir"], cwd) == 0


def toplevel(cwd=None) -> Path:
    return Path(run_text(["rev-parse", "--show-toplevel"], cwd))


def common_dir(cwd=None) -> Path:
    """The shared .git directory (the same for every worktree): home of lfs/objects and hooks."""
    if (r := _snapshot(cwd)) is not None:
        return r.common_dir
    return _absolute(run_text(["rev-parse", "--git-common-dir"], cwd), cwd)


def hooks_dir(cwd=None) -> Path:
    """Where git looks for hooks, honouring core.hooksPath."""
    if (r := _snapshot(cwd)) is not None:
        return r.hooks_dir
    return _absolute(run_text(["rev-parse", "--git-path", "hooks"], cwd), cwd)


def git_path(name: str, cwd=None) -> Path:
    """``git rev-parse --git-path NAME`` made absolute (honours GIT_INDEX_FILE for "index", worktrees...)."""
    if name == "index" and (r := _snapshot(cwd)) is not None:
        return r.index_file
    return _absolute(run_text(["rev-parse", "--git-path", name], cwd), cwd)


def object_format(cwd=None) -> str:
    """The repository's hash algorithm: "sha1" or "sha256"."""
    if (r := _snapshot(cwd)) is not None and r.object_format:
        return r.object_format
    return run_text(["rev-parse", "--show-object-format"], cwd, check=False) or "sha1"


def blob_id(data: bytes, hash_name: str = "sha1") -> str:
    """The id git gives a blob of these bytes (what `git hash-object` prints, without running git)."""
    h = hashlib.new(hash_name)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


# git's options that take their value as the next argument (git(1): before the subcommand)
_GIT_OPTIONS_WITH_VALUE = {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--super-prefix",
                           "--attr-source"}


def git_subcommand(argv: list[str]) -> str | None:
    """``checkout`` for ``git -C x -c a=b checkout main``; ``archive`` for ``git-archive ...``; else None."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name.startswith("git-") and name not in ("git-theta", "git-theta-filter", "git-lfs"):
        return name[4:]
    if name != "git":
        return None
    args = iter(argv[1:])
    for a in args:
        if a in _GIT_OPTIONS_WITH_VALUE:
            next(args, None)
        elif not a.startswith("-"):
            return a
    return None


def _proc_parent(pid: int) -> tuple[list[str], int] | None:
    """(command line, parent pid) of a process from Linux's /proc (no psutil import at a filter's start);
    None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "surrogateescape") for a in f.read().split(b"\0")[:-1]]
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return argv, int(stat[stat.rindex(b")") + 2:].split()[1])  # fields after the command name: state, ppid
    except (OSError, ValueError, IndexError):
        return None


def invoking_subcommand() -> str | None:
    """The subcommand of the git process that started this one (through the shell git runs filters with),
    e.g. "checkout" or "archive"; None when no git process is found."""
    if os.path.isdir("/proc/self"):
        pid = os.getppid()
        for _ in range(4):
            found = _proc_parent(pid) if pid > 0 else None
            if found is None:  # no parent, gone, or not ours to read: unknown
                return None
            cmd = git_subcommand(found[0])
            if cmd is not None:
                return cmd
            pid = found[1]
        return None
    try:
        import psutil

        p = psutil.Process(os.getppid())
        for _ in range(4):
            if p is None:
                return None
            cmd = git_subcommand(p.cmdline())
            if cmd is not None:
                return cmd
            p = p.parent()
    except Exception:  # psutil missing, a process gone, no permission: unknown
        return None
    return None


def theta_dir(cwd=None) -> Path:
    """<git-common-dir>/theta: scratch space on the repository's file system (spool files)."""
    d = common_dir(cwd) / "theta"
    d.mkdir(exist_ok=True)
    return d


def scratch_dir(cwd=None, pid: int | None = None) -> Path:
    """This process's own temp directory (or process ``pid``'s), ``<git-common-dir>/theta/tmp/<pid>-<start
    time>``, after removing what killed theta processes left there (:mod:`theta.base.scratch`)."""
    parent = theta_dir(cwd) / "tmp"
    parent.mkdir(exist_ok=True)
    scratch.sweep(parent)
    return scratch.owned_dir(parent, pid)


# -- reads remembered for a process's life (the filter) ---------------------------------------------
class _Remembered:
    """One ``git config -l -z`` and one ``git rev-parse`` for a repository, answering the filter's reads of
    config keys, directories, the index file and the object format (they were 6 git processes before the first
    byte of a `git add` was cleaned, and 3 more before a checkout's materialization, ~5 ms each). Only while :func:`remember_reads` is on, for that repository; a config write forgets it."""

    def __init__(self, cwd):
        self.cwd = os.path.realpath(cwd or ".")
        self.config: dict[str, list[str]] = {}
        # both git processes at once (on a 2-core machine the filter's own start leaves a core idle)
        pipes = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        config = subprocess.Popen(["git", "config", "-l", "-z"], cwd=cwd, **pipes)
        # the object format in the same call (git >= 2.25); an older git answers the rest without it
        asked = ["rev-parse", "--git-common-dir", "--git-path", "hooks", "--git-path", "index"]
        where = subprocess.Popen(["git", *asked, "--show-object-format"], cwd=cwd, **pipes)
        out, err = config.communicate()
        where_out, _ = where.communicate()
        if config.returncode != 0:
            raise GitError(f"git config -l: {err.decode('utf-8', 'replace').strip()}")
        for item in out.decode("utf-8").split("\0"):
            if item:
                key, nl, value = item.partition("\n")
                self.config.setdefault(key, []).append(value if nl else "")
        lines = where_out.decode("utf-8", "surrogateescape").split("\n") if where.returncode == 0 else []
        if len(lines) < 4:
            lines = run_text(asked, cwd).split("\n") + [""]
        common, hooks, index, fmt = lines[:4]
        self.common_dir = _absolute(common, cwd)
        self.hooks_dir = _absolute(hooks, cwd)
        self.index_file = _absolute(index, cwd)
        self.object_format = fmt or None

    def get(self, key: str) -> str | None:
        values = self.config.get(_canonical_key(key))
        return values[-1] if values else None  # as `git config --get`: the last value wins

    def get_regexp(self, pattern: str) -> dict[str, str]:
        rx = re.compile(pattern)
        return {k: v[-1] for k, v in self.config.items() if rx.search(k)}


def _canonical_key(key: str) -> str:
    """git's spelling of a config key in ``git config -l``: section and name lower-cased, subsection as is."""
    section, _, rest = key.partition(".")
    sub, dot, name = rest.rpartition(".")
    return f"{section.lower()}.{sub}{dot}{name.lower()}" if dot else f"{section.lower()}.{rest.lower()}"


def _absolute(d: str, cwd) -> Path:
    """A path git printed (relative to ``cwd`` unless absolute) made absolute."""
    p = Path(d)
    return p if p.is_absolute() else (Path(cwd or ".") / p).resolve()


_remembered: _Remembered | None = None


def remember_reads(cwd) -> None:
    """From now on, answer config reads (no scope) and the common/hooks directories of the repository at
    ``cwd`` from one snapshot: for a process that serves git for one command (the filter process)."""
    global _remembered
    _remembered = _Remembered(cwd)


def _snapshot(cwd) -> "_Remembered | None":
    r = _remembered
    if r is not None and os.path.realpath(cwd or ".") == r.cwd:
        return r
    return None


def _forget() -> None:
    global _remembered
    _remembered = None


# -- config -------------------------------------------------------------------------------------------
def config_get(key: str, cwd=None, scope: str | None = None) -> str | None:
    if scope is None and (r := _snapshot(cwd)) is not None:
        return r.get(key)
    args = ["config"] + ([f"--{scope}"] if scope else []) + ["--get", key]
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True)
    if proc.returncode == 1:  # key not set
        return None
    if proc.returncode != 0:
        raise GitError(f"git config --get {key}: {proc.stderr.decode('utf-8', 'replace').strip()}")
    return proc.stdout.decode("utf-8").rstrip("\n")


def config_get_regexp(pattern: str, cwd=None) -> dict[str, str]:
    """All config keys matching ``pattern`` (keys are lower-cased by git)."""
    if (r := _snapshot(cwd)) is not None:
        return r.get_regexp(pattern)
    proc = subprocess.run(["git", "config", "-z", "--get-regexp", pattern], cwd=cwd, capture_output=True)
    if proc.returncode == 1:
        return {}
    if proc.returncode != 0:
        raise GitError(f"git config --get-regexp {pattern}: {proc.stderr.decode('utf-8', 'replace').strip()}")
    out = {}
    for item in proc.stdout.decode("utf-8").split("\0"):
        if item:
            key, _, value = item.partition("\n")
            out[key] = value
    return out


def config_set(key: str, value: str, cwd=None, scope: str = "global") -> None:
    """``key`` = ``value`` in ``scope``, its only value there (a key set several times is replaced whole)."""
    _forget()
    run(["config", f"--{scope}", "--replace-all", key, value], cwd=cwd)


def config_unset(key: str, cwd=None, scope: str = "global") -> bool:
    """Remove every value of ``key`` in ``scope``; False when it was not set."""
    _forget()
    proc = subprocess.run(["git", "config", f"--{scope}", "--unset-all", key], cwd=cwd, capture_output=True)
    if proc.returncode == 5:  # not set
        return False
    if proc.returncode != 0:
        raise GitError(f"git config --unset-all {key}: {proc.stderr.decode('utf-8', 'replace').strip()}")
    return True


def config_remove_section_if_empty(section: str, cwd=None, scope: str = "global") -> bool:
    """Remove ``[section]`` (e.g. ``filter.theta``) from ``scope`` when no key is left in it."""
    _forget()
    keys = subprocess.run(["git", "config", f"--{scope}", "--get-regexp", "^" + section.replace(".", r"\.") + r"\."],
                          cwd=cwd, capture_output=True)
    if keys.returncode == 0 and keys.stdout.strip():
        return False
    return run_status(["config", f"--{scope}", "--remove-section", section], cwd) == 0


# -- attributes --------------------------------------------------------------------------------------
def check_attr(attr: str, paths: Iterable[str], cwd=None) -> dict[str, str | None]:
    """The value of ``attr`` for each path (None when unspecified), via one `git check-attr` call."""
    paths = list(paths)
    if not paths:
        return {}
    out = run(["check-attr", "-z", "--stdin", attr], cwd=cwd, input=b"".join(p.encode() + b"\0" for p in paths))
    fields = out.split(b"\0")
    result: dict[str, str | None] = {}
    for i in range(0, len(fields) - 2, 3):
        path, _, value = fields[i].decode(), fields[i + 1], fields[i + 2].decode()
        result[path] = None if value in ("unspecified", "unset") else value
    return result


# -- objects -----------------------------------------------------------------------------------------
def read_blob(spec: str, cwd=None) -> bytes | None:
    """The content of ``spec`` (e.g. ``HEAD:model.pt`` or ``:model.pt``), or None if it does not exist."""
    proc = subprocess.run(["git", "cat-file", "blob", spec], cwd=cwd, capture_output=True)
    return proc.stdout if proc.returncode == 0 else None


@dataclass(frozen=True)
class ObjectInfo:
    sha: str
    type: str
    size: int


class CatFile:
    """One `git cat-file --batch` process for reading many objects (closed on exit)."""

    def __init__(self, cwd=None):
        self.proc = subprocess.Popen(["git", "cat-file", "--batch"], cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)

    def read(self, spec: str) -> tuple[ObjectInfo | None, bytes]:
        self.proc.stdin.write(spec.encode() + b"\n")
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().decode().split()
        if len(header) != 3:  # "<spec> missing"
            return None, b""
        sha, typ, size = header[0], header[1], int(header[2])
        data = self.proc.stdout.read(size)
        self.proc.stdout.read(1)  # the newline after the content
        return ObjectInfo(sha, typ, size), data

    def read_if(self, spec: str, prefixes: tuple[bytes, ...]) -> bytes | None:
        """The content of ``spec`` when it starts with one of ``prefixes``, else None; a blob that does not
        is skipped in chunks, never held whole in memory."""
        self.proc.stdin.write(spec.encode() + b"\n")
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().decode().split()
        if len(header) != 3:
            return None
        size = int(header[2])
        want = max(len(x) for x in prefixes)
        head = self.proc.stdout.read(min(size, want))
        if head.startswith(prefixes) or any(x.startswith(head) for x in prefixes if len(head) < len(x)):
            data = head + self.proc.stdout.read(size - len(head))
            self.proc.stdout.read(1)
            return data if data.startswith(prefixes) else None
        left = size - len(head)
        while left:
            left -= len(self.proc.stdout.read(min(left, 1 << 20)))
        self.proc.stdout.read(1)
        return None

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batch_check(specs: Iterable[str], cwd=None) -> list[ObjectInfo | None]:
    data = "".join(s + "\n" for s in specs).encode()
    out = run(["cat-file", "--batch-check"], cwd=cwd, input=data).decode().splitlines()
    infos: list[ObjectInfo | None] = []
    for line in out:
        parts = line.split()
        infos.append(ObjectInfo(parts[0], parts[1], int(parts[2])) if len(parts) == 3 else None)
    return infos


def rev_exists(rev: str, cwd=None, kind: str = "object") -> bool:
    """True when ``rev`` names an object (``kind``: "object", "commit", ...)."""
    return run_status(["rev-parse", "--verify", "--quiet", f"{rev}^{{{kind}}}"], cwd) == 0


def object_exists(spec: str, cwd=None) -> bool:
    """True when ``spec`` (e.g. ``:2:model.pt``) names an existing object."""
    return run_status(["cat-file", "-e", spec], cwd) == 0
