"""The filter process's side of the warm filter: hand git's pipes to a warm server, wait for its child's exit.

Kept light: it runs before git gets its handshake. So no numpy, no theta module beyond :mod:`theta.warm`, and the C modules under
``socket`` and ``signal`` rather than those wrappers (they import ``enum`` and ``selectors``: ~3 ms).
"""
from __future__ import annotations

import _signal
import _socket
import json
import os
import struct
import sys

from theta import warm

_FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT)
_key: str | None = None   # this process's key, once computed (spawn_server reuses it)


def _path(d: str, k: str, what: str) -> str:
    return os.path.join(d, f"{k}.{what}")


def run(argv: list[str]) -> int | None:
    """Serve git's filter protocol through a warm server: the child's exit status, or None when there is no
    server to take it (the caller then starts cold)."""
    global _key
    d = warm.runtime_dir()
    if d is None:
        return None
    _key = warm.key()
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)  # (a server accepts at once; one that does not is not waited for)
        s.connect(_path(d, _key, warm.SOCKET))
        s.settimeout(None)  # once git's pipes are sent, the child has them: it is waited for, however long
        uid = struct.unpack("3i", s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[2]
        if uid != os.getuid():
            s.close()
            return None  # (the directory is ours and closed to others: cannot happen unless root was there)
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
                              "parent": os.getppid(), "client": os.getpid()}).encode()
        s.sendmsg([struct.pack("!I", len(request)), request],
                  [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))])
        answer = _recv_exactly(s, 9)
    except OSError:
        s.close()
        return None
    if answer is None or answer[:1] != b"R":  # refused (stale code) or gone: start cold
        s.close()
        return None
    child = struct.unpack("!q", answer[1:])[0]

    forwarded: list[int] = []

    def forward(signum, _frame):
        forwarded.append(signum)
        try:
            os.kill(child, signum)
        except OSError:
            pass
    for sig in _FORWARDED:
        _signal.signal(sig, forward)
    # git's pipes are the child's alone now: git sees their end when the child ends
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    try:
        end = _recv_exactly(s, 5)
    except OSError:
        end = None
    if end is None or end[:1] != b"X":
        if forwarded:  # the signal ended the child: end as a cold filter would have, by the same signal
            _signal.signal(forwarded[-1], _signal.SIG_DFL)
            os.kill(os.getpid(), forwarded[-1])
        print("git-theta: error: the warm filter process ended without an exit status (killed?)", file=sys.stderr)
        return 1
    return struct.unpack("!i", end[1:])[0]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _recv_exactly(s: _socket.socket, n: int) -> bytes | None:
    got = b""
    while len(got) < n:
        try:
            b = s.recv(n - len(got))
        except InterruptedError:
            continue
        if not b:
            return None
        got += b
    return got


def spawn_server() -> None:
    """Start a warm server for this process's key in the background, if none is there (best effort: a filter
    never fails for it). It is a new session, holds none of git's pipes, and outlives this process."""
    d = warm.runtime_dir()
    if d is None:
        return
    k = _key or warm.key()
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(_path(d, k, warm.SOCKET))
        return  # one is there (started by another filter meanwhile)
    except OSError:
        pass
    finally:
        s.close()
    warm.sweep(d)
    if len(warm.servers(d)) >= warm.MAX_SERVERS:
        return  # (processes that differ in sys.path, limits... would each leave one: a few are enough)
    import subprocess

    code = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
            "from theta.warm.server import main; main(sys.argv[2], sys.argv[3])")
    try:
        subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), d, k], cwd="/",
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:
        pass


def leaving(code: int) -> None:
    """The filter process ends now with ``code`` (called just before ``os._exit``): a warm child reports it to
    its client; a cold filter leaves a server for the next one."""
    if warm._on_exit is not None:
        warm._on_exit(code)
    elif warm.enabled():
        spawn_server()
