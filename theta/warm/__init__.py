"""A warm filter: git's filter process served by a fork of a process that has already imported theta.

git starts ``git-theta filter-process`` for every add, checkout, switch and merge that touches a tracked
checkpoint, and a Python filter spends ~0.1-0.2 s of CPU on the interpreter, numpy and theta's modules before
it can answer git (a Go filter such as git-lfs starts in ~20 ms). With the warm filter, the first filter
process of a user leaves behind a small server (:mod:`theta.warm.server`, the "zygote") that has imported all
of that and waits on a Unix socket in a private directory; each later filter process (:mod:`theta.warm.client`)
hands it git's pipes, its environment and its working directory, and the server forks a child that serves git
exactly as the filter would have, already started. The client stays git's child until the work is done: it
forwards signals, returns the child's exit status, and the child ends if the client is killed.

The server is keyed by everything that decides what code runs and under which limits (:func:`key`): the
interpreter, ``sys.path``, the user and groups, the memory cgroup, the namespaces, the resource limits, the
environment variables read before ``main`` (Python's, the C library's, the BLAS libraries'). A server whose
loaded source files changed since it started (an upgrade, an edited editable install) refuses and exits. It
ends after ``GIT_THETA_WARM_IDLE`` seconds without a request (default 600). ``GIT_THETA_WARM=0`` turns it off.
See docs/design/warm.md.
"""
from __future__ import annotations

import os
import sys

IDLE_SECONDS = 600.0
MAX_SERVERS = 4     # live servers per user and directory: a filter whose key has none starts one only below this
SOCKET = "s"        # <dir>/<key>.s: the server's socket
LOCK = "lock"       # <dir>/<key>.lock: held (flock) by the live server of that key

# set in a warm child (theta.warm.server): the process that started the client (git), and how to report the
# child's end to the client
_parent: int | None = None
_on_exit = None


def enabled() -> bool:
    """Whether filter processes use (and leave) a warm server: on where the system can pass file descriptors
    between processes (Linux), unless ``GIT_THETA_WARM=0``."""
    if os.environ.get("GIT_THETA_WARM", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return sys.platform.startswith("linux") and hasattr(os, "fork") and _parent is None


def idle_seconds() -> float:
    """``GIT_THETA_WARM_IDLE``: seconds a server waits for a request before it exits."""
    try:
        return max(1.0, float(os.environ.get("GIT_THETA_WARM_IDLE", "")))
    except ValueError:
        return IDLE_SECONDS


def parent_pid() -> int:
    """The pid of the process that started this filter: git. In a warm child that is the client's parent, not
    the server that forked it."""
    return _parent if _parent is not None else os.getppid()


def runtime_dir() -> str | None:
    """The user's private directory for servers' sockets (``GIT_THETA_WARM_DIR``, else
    ``$XDG_RUNTIME_DIR/git-theta``, else ``/tmp/git-theta-<uid>``), created 0700; None when it is not a
    directory of this user that no one else may enter (then nothing is warm)."""
    d = os.environ.get("GIT_THETA_WARM_DIR")
    if not d:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        d = os.path.join(xdg, "git-theta") if xdg and os.path.isabs(xdg) else f"/tmp/git-theta-{os.getuid()}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(d)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None  # a symlink, another user's, or open to others: never ours to trust
    return d


# environment read by the interpreter, the C library or native libraries when the process starts, i.e. before
# a warm child could apply the client's: a different value needs a server of its own
_START_ENV = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OPENBLAS_", "OMP_", "MKL_", "NUMPY_", "LANG", "LC_")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def key() -> str:
    """The name of the server that may serve this process: a hash of what makes two processes run the same
    code under the same limits.

    The same whether or not ``site`` ran in this process and whichever name of the interpreter
    started it (``python3`` or ``python3.11``; a virtual environment's prefix tells it apart). So not
    ``sys.path`` itself but what decides it: the interpreter and its prefixes, ``PYTHONPATH`` (the environment
    below), and the site directories ``site`` adds, each with its modification time (a package installed or
    removed changes it) and its ``.pth`` and ``*customize.py`` files, which ``site`` runs."""
    import resource

    ns = []
    for n in ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup"):
        try:
            ns.append(os.readlink(f"/proc/self/ns/{n}"))
        except OSError:
            ns.append("")
    limits = []
    for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
        try:
            limits.append((name, resource.getrlimit(getattr(resource, name))))
        except (OSError, ValueError):
            pass
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = []
    flags = [(f, getattr(sys.flags, f)) for f in dir(sys.flags)
             if not f.startswith("_") and f not in ("no_site", "count", "index", "n_fields", "n_sequence_fields",
                                                    "n_unnamed_fields")]
    what = repr((
        ("exe", os.path.realpath(sys.executable), sys.version, sys.prefix, sys.exec_prefix, sys.base_prefix,
         sys.base_exec_prefix),
        ("flags", flags), ("site", _site_dirs()),
        ("ids", os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())),
        ("cgroup", _read("/proc/self/cgroup")), ("ns", ns), ("limits", limits), ("nice", os.nice(0)),
        ("affinity", affinity), ("env", sorted((k, v) for k, v in os.environ.items() if k.startswith(_START_ENV))),
    )).encode()
    try:  # (hashlib loads OpenSSL, ~3 ms before the handshake; blake2 is built into every CPython 3)
        from _blake2 import blake2b
    except ImportError:
        from hashlib import blake2b
    return blake2b(what, digest_size=12).hexdigest()


def _site_dirs() -> list:
    """The site directories ``site`` adds to ``sys.path`` (whether or not it ran here), each with its
    modification time and its ``.pth`` / ``*customize.py`` files (name, size, modification time)."""
    import site

    dirs = list(site.getsitepackages())
    if site.check_enableusersite():
        dirs.append(site.getusersitepackages())
    out = []
    for d in dirs:
        try:
            mtime = os.stat(d).st_mtime_ns
            names = sorted(n for n in os.listdir(d) if n.endswith((".pth", "customize.py")))
        except OSError:
            out.append((d, None))
            continue
        files = []
        for n in names:
            try:
                st = os.stat(os.path.join(d, n))
                files.append((n, st.st_size, st.st_mtime_ns))
            except OSError:
                pass
        out.append((d, mtime, files))
    return out


def _probe(path: str) -> tuple[int, bool] | None:
    """``path`` (a server's lock file) opened: (fd, held by a server). When not held, this process now holds it
    (an exclusive lock, released when ``fd`` is closed). None when it cannot be opened (gone, a symlink)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, False
    except OSError:
        return fd, True


def servers(d: str | None = None) -> list[tuple[str, int]]:
    """(key, pid) of each live server in ``d`` (default: :func:`runtime_dir`): those holding their lock."""
    d = d or runtime_dir()
    found = []
    try:
        names = sorted(os.listdir(d)) if d is not None else []
    except OSError:
        return found  # (no such directory: no server)
    for name in names:
        probed = _probe(os.path.join(d, name)) if name.endswith("." + LOCK) else None
        if probed is None:
            continue
        fd, held = probed
        try:
            if held:
                found.append((name[:-len(LOCK) - 1], int(os.read(fd, 32).split()[0])))
        except (ValueError, IndexError, OSError):
            pass
        finally:
            os.close(fd)
    return found


def sweep(d: str) -> int:
    """Remove the files of servers that are gone (killed: SIGKILL, a memory cgroup's kill) from ``d``: each lock
    file no process holds, then each socket whose key has no lock file; how many were removed. A server
    creates and holds its lock before it binds its socket, so neither pass can take a live server's file."""
    removed = 0
    for what in (LOCK, SOCKET):
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith("." + what))
        except OSError:
            return removed
        for name in names:
            p = os.path.join(d, name)
            fd = None
            if what == LOCK:
                probed = _probe(p)
                if probed is None or probed[1]:  # (held: a live server's)
                    if probed is not None:
                        os.close(probed[0])
                    continue
                fd = probed[0]
            elif os.path.lexists(p[:-len(SOCKET)] + LOCK):
                continue
            try:
                os.unlink(p)  # (a server that opened this lock file before now finds it gone: theta.warm.server)
                removed += 1
            except OSError:
                pass
            if fd is not None:
                os.close(fd)
    return removed


def stop(d: str | None = None) -> int:
    """Ask every live server in ``d`` to exit (SIGTERM; children serving git go on); how many were asked."""
    import signal

    n = 0
    for _, pid in servers(d):
        try:
            os.kill(pid, signal.SIGTERM)
            n += 1
        except OSError:
            pass
    return n
