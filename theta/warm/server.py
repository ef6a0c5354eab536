"""The warm server: a process that imported what git's filter needs, forking a started filter per request.

It stays single-threaded (a fork copies only the forking thread: a lock another thread held would stay held in
the child), so it starts no pool and no thread; the child starts its own, as a cold filter does.
"""
from __future__ import annotations

import array
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys

from theta import warm

# what a filter's clean and checkout import, imported once here instead of in every filter process
PRELOAD = ("numpy", "zstandard", "xxhash", "theta.commands.filter.process", "theta.commands.filter.forked_receive",
           "theta.commands.hooks", "theta.commands.filter.materialize", "theta.model.clean", "theta.model.views", "theta.model.smudge",
           "theta.model.framewise", "theta.base.lsh", "theta.updates.auto", "theta.updates.bounds",
           "theta.storage.store", "theta.storage.transfer", "theta.git.index", "theta.peers.gittheta.files",
           "zipslice", "zipslice.sharded", "zipslice.torch_reader", "zipslice.clistyle")
MAX_REQUEST = 1 << 20   # bytes of a request (argv, cwd, environment)


def main(d: str, k: str) -> None:
    """Serve key ``k`` from directory ``d`` until idle (started by :func:`theta.warm.client.spawn_server`)."""
    lock_path = os.path.join(d, f"{k}.{warm.LOCK}")
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another server has this key
    if not _same_file(lock, lock_path):
        return  # swept (warm.sweep) between our open and our lock: a later filter starts a server again
    signal.signal(signal.SIGTERM, _terminated)  # (warm.stop: leave through the cleanup below)
    path = os.path.join(d, f"{k}.{warm.SOCKET}")
    ino = None
    try:
        os.ftruncate(lock, 0)
        os.write(lock, b"%d\n" % os.getpid())  # (theta.warm.servers reads it while the lock is held)
        _name_self(b"git-theta-warm")
        sources = _preload()
        try:
            os.unlink(path)  # a dead server's (we hold the lock)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        ino = os.stat(path).st_ino
        # a child keeps neither: the lock would outlive the server, and a client could queue on the socket of
        # a server that is gone
        _server_fds.extend((lock, listener.fileno()))
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
        idle = warm.idle_seconds()
        while select.select([listener], [], [], idle)[0]:
            conn, _ = listener.accept()
            if _serve(conn, sources) == "stale":
                break
            try:
                if os.stat(path).st_ino != ino:
                    break  # our socket was removed or replaced: no client can reach us
            except OSError:
                break
    finally:
        # the socket, then the lock file (still held: a server starting now either locked the old file, and
        # finds it gone, or creates a new one)
        try:
            if ino is not None and os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass
        if _same_file(lock, lock_path):
            try:
                os.unlink(lock_path)
            except OSError:
                pass


def _preload() -> dict[str, tuple[int, int]]:
    """Import what a filter needs, set the filter's process-wide policies; the loaded sources' stamps."""
    from theta.commands.entry import few_collections, reuse_freed_memory, single_threaded_blas

    single_threaded_blas()
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass  # (an optional module missing: the child imports it, or fails, as a cold filter would)
    reuse_freed_memory()
    few_collections()
    import gc

    gc.collect()
    gc.freeze()  # what the server allocated stays out of the children's collections (and their pages shared)
    return _sources()


_server_fds: list[int] = []


def _terminated(signum, _frame) -> None:
    raise SystemExit(0)


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open on ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _name_self(name: bytes) -> None:
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(name)
    except OSError:
        pass


def _sources() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every loaded theta and zipslice source file."""
    out = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and (m.__name__.split(".")[0] in ("theta", "zipslice")):
            try:
                st = os.stat(f)
                out[f] = (st.st_mtime_ns, st.st_size)
            except OSError:
                out[f] = (0, 0)
    return out


def _changed(sources: dict) -> bool:
    for f, was in sources.items():
        try:
            st = os.stat(f)
        except OSError:
            return True
        if (st.st_mtime_ns, st.st_size) != was:
            return True
    return False


def _serve(conn: socket.socket, sources: dict) -> str:
    """Take one request: fork its child, or refuse it ("stale": the code changed since this server started)."""
    fds = array.array("i")
    try:
        creds = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if creds[1] != os.getuid():
            return "refused"
        conn.settimeout(5.0)
        head, anc, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if len(head) != 4 or len(fds) != 3:
            return "refused"
        n = struct.unpack("!I", head)[0]
        if n > MAX_REQUEST:
            return "refused"
        body = b""
        while len(body) < n:
            b = conn.recv(n - len(body))
            if not b:
                return "refused"
            body += b
        request = json.loads(body)
        if _changed(sources):
            conn.sendall(b"S")
            return "stale"
        pid = os.fork()
        if pid == 0:  # (the child answers the client)
            _child(conn, fds, request)  # never returns
        return "served"
    except (OSError, ValueError, KeyError, TypeError):
        return "refused"
    finally:
        conn.close()
        for fd in fds:
            os.close(fd)


def _child(conn: socket.socket, fds, request: dict) -> None:
    """The forked filter: git's pipes on 0, 1 and 2, the client's directory, environment and umask."""
    code = 1
    try:
        # a filter ends by SIGTERM, as a cold one would: reset before the client learns this pid and can pass
        # one on (the server's handler would turn it into a clean exit with status 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # the child says it exists (not the server: a client that hears nothing knows no child has git's pipes)
        for fd in _server_fds:
            os.close(fd)
        conn.sendall(b"R" + struct.pack("!q", os.getpid()))
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            os.close(fd)
        os.setsid()  # (not the server's session: a signal to the server's group never reaches a filter)
        _name_self(b"git-theta-filt")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.umask(int(request["umask"]))
        _client["pid"] = int(request["client"])
        warm._parent = int(request["parent"])
        warm._on_exit = lambda c: _report(conn, c)
        _watch(_client["pid"])
        _reconfigure()
        _ledger("start")
        sys.argv = ["git-theta", "filter-process", *request["argv"]]
        from theta.commands.entry import filter_main

        code = filter_main(list(request["argv"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        _report(conn, code)
        os._exit(code)


_client = {"pid": 0, "reported": False}  # (in a child) its client, and whether its end was reported


def _report(conn: socket.socket, code: int) -> None:
    """Tell the client how the child ended (then the client exits with ``code``); once."""
    if _client["reported"]:
        return
    _client["reported"] = True
    _ledger("end")
    try:
        conn.sendall(b"X" + struct.pack("!i", code))
    except OSError:
        pass


def _watch(client: int) -> None:
    """End this child when its client ends first (killed: git, a user or the OOM killer meant the filter)."""
    import threading

    try:
        fd = os.pidfd_open(client)
    except ProcessLookupError:
        os._exit(1)  # already gone: git has nothing to wait for
    except (AttributeError, OSError):
        return  # (Linux before 5.3) git's pipes still end the child when git goes

    def wait():
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=wait, name="warm-client", daemon=True).start()


def _reconfigure() -> None:
    """What theta's modules read from the environment when imported, read again from the client's."""
    from theta.base import faults, parallel

    faults.configure()
    parallel.configure()


def _ledger(what: str) -> None:
    """``GIT_THETA_WARM_LEDGER``: a file the benchmarks name to count a warm child in the command that used it
    (its pid when it starts, its CPU time and peak RSS when it ends): it is not in git's process tree."""
    path = os.environ.get("GIT_THETA_WARM_LEDGER")
    if not path:
        return
    import resource

    entry = {"what": what, "pid": os.getpid(), "client": _client["pid"]}
    if what == "end":
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        entry.update(cpu=me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, maxrss=me.ru_maxrss * 1024)
    try:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        pass
