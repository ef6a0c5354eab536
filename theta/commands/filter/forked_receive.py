"""git's bytes of a filter's first clean request, received by a forked child while the filter starts.

git sends the whole file as soon as the filter has read the request; until then it waits, and on a 2-core
machine a core sits idle while the filter imports numpy and its modules (~0.1-0.15 s). A thread cannot
receive meanwhile (the imports hold the GIL), but a child forked right after the request was read can: it
owns nothing but the pipe, the work-tree file and a pipe back to the filter. It lays the file out as a zip
(numpy-free :mod:`zipslice.zipfmt`), hashes each stored member's bytes as git sends them (xxh3-128, as
:mod:`theta.model.git_bytes` does for groups) and compares every other byte with the file (the same
:func:`theta.commands.filter.receive.receive`). It reports each member's hash as it ends, then where the content
lives (the file itself, or a spool file when git's bytes were not the file's) and any bytes it read past the
content.

The filter, once started, matches the members to its groups: a group whose byte range is a member's gets
git's hash from it (:class:`theta.model.git_bytes.GroupHashes`), and a member no group took is checked against the
file (:meth:`ForkedReceive.received`), so every byte the clean uses is proven to be git's, as before.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from theta.base import faults
from theta import settings
from theta.base.errors import FileChanged, ProtocolError, ThetaError
from theta.git.pktline import grow_pipe
from theta.model.git_bytes import GroupHashes


def wanted(header: dict, cwd: Path) -> Path | None:
    """The work-tree file of a clean request whose content a child should receive, else None: a zip (torch's
    format; the members are laid out without numpy), a fork to make and a thread to clean on."""
    from theta.base import parallel

    path = header.get("pathname", "")
    if header.get("command") != "clean" or not path or not hasattr(os, "fork"):
        return None
    if parallel.CODEC_THREADS <= 1 or settings.env("SPOOL") == "always" or settings.env("FORK_RECEIVE") == "0":
        return None  # (one thread: nothing runs beside anything else, as everywhere with GIT_THETA_THREADS=1)
    file = cwd / path
    try:
        with open(file, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return None
    except OSError:
        return None
    return file


NAME = "git-theta-recv"  # the child's process name (ps, top; the benchmark counts its own pages by it)


def start(reader, file: Path, cwd: Path) -> "ForkedReceive":
    """Fork the child that receives the current request's content from ``reader`` (its header was read)."""
    r, w = os.pipe()
    # 1 MiB for the reports (~11,000 members' hashes): the child must not wait for the filter, which reads
    # them only once its clean has laid the file out
    grow_pipe(w)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            quiet = os.open(os.devnull, os.O_RDWR)  # git's stdout is the filter's alone: the child never answers
            os.dup2(quiet, 1)
            os.close(quiet)
            _name_self()
            _child(reader, file, cwd, w)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return ForkedReceive(pid, r, reader)


def _name_self() -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(NAME)
    except OSError:
        pass  # (not Linux)


class ForkedReceive:
    """The filter's end: the child's reports, read when the clean needs them."""

    def __init__(self, pid: int, fd: int, reader):
        self.pid, self.reader = pid, reader
        reader.take_unread()  # the child has them (content bytes read with the request's header)
        self.f = os.fdopen(fd, "rb")

    def received(self, file: Path | None, hashes: GroupHashes | None):
        """The content's :class:`~theta.commands.filter.receive.Received` once the child has it all; ``hashes`` (the
        early clean's) gets git's hash of each group whose range is a member's. The members no group took are
        checked against ``file`` (None: the content will not be used)."""
        from theta.commands.filter.receive import Received

        try:
            keys = {(s, e): k for s, e, k in hashes.layout()} if hashes is not None else {}
            untaken = []
            for line in self.f:
                kind, _, rest = line.rstrip(b"\n").partition(b" ")
                if kind == b"H":
                    s, e, digest = rest.split()
                    s, e, digest = int(s), int(e), digest.decode()
                    key = keys.pop((s, e), None)
                    if key is not None:
                        hashes.put(key, digest)
                    else:
                        untaken.append((s, e, digest))
                elif kind == b"E":  # the end: where the content is (or what went wrong), and what follows it
                    end = json.loads(rest)
                    head, left = self.f.read(end["head"]), self.f.read(end["left"])
                    if len(head) != end["head"] or len(left) != end["left"]:
                        break
                    self.reader.unread(left)
                    if end["error"] is not None:
                        raise (FileChanged if end["changed"] else ThetaError)(end["error"])
                    got = Received(Path(end["path"]), end["owned"], head, end["size"])
                    if file is not None and not got.owned:
                        _check_untaken(file, untaken)
                    return got
                elif kind == b"P":  # git's stream broke: nothing more can be read from it
                    raise ProtocolError(json.loads(rest))
            raise ProtocolError("filter protocol: the process receiving git's bytes ended without an answer")
        finally:
            if hashes is not None:
                hashes.end()
            self.close()

    def abandon(self) -> None:
        """The request failed before its content was used: let the child finish, drop what it kept."""
        if self.f is None:
            return
        try:
            got = self.received(None, None)
            got.cleanup()
        except (ThetaError, OSError):
            pass

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
            os.waitpid(self.pid, 0)


def _check_untaken(file: Path, untaken: list) -> None:
    """The file's bytes of each member no group took must be git's (the child only hashed them)."""
    from theta.commands.filter.receive import file_changed, next_digest

    if not untaken:
        return
    with open(file, "rb") as f:
        for s, e, digest in untaken:
            f.seek(s)
            if next_digest(f, e - s) != digest:
                raise file_changed(file)


# -- the child -----------------------------------------------------------------------------------------------
class _Reporting(GroupHashes):
    """The members' ranges as the layout, each hash written to the filter as it ends."""

    def __init__(self, name: str, ranges: list, out):
        super().__init__(name)
        self.expect(ranges)
        self.out = out

    def put(self, key: tuple[int, int], digest: str) -> None:
        self.out.write(b"H %d %d %s\n" % (*key, digest.encode()))
        faults.point("receive:forked")


def _member_ranges(file: Path) -> list[tuple[int, int, tuple[int, int]]]:
    """(start, end, (start, end)) of each stored member with bytes (the range is its key); [] when ``file`` is
    no zip theta can read (then every byte is compared with the file)."""
    from zipslice.errors import ZipsliceError
    from zipslice.zipfmt import ZipIndex

    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return []
    try:
        zi = ZipIndex(fd, str(file))
        members = [m for m in (zi.members[n] for n in zi.order) if m.method == 0 and m.compressed_size]
        spans = [(m.data_offset, m.data_offset + m.compressed_size) for m in zi.resolve_many(members)]
        return [(s, e, (s, e)) for s, e in spans]
    except (ZipsliceError, OSError, ValueError):
        return []
    finally:
        os.close(fd)


class _LazyDir(os.PathLike):
    """The filter's own scratch directory (the spool file is the filter's once the child is gone), asked of
    git only if git's bytes must be spooled."""

    def __init__(self, cwd: Path):
        self.cwd, self.path = cwd, None

    def __fspath__(self) -> str:
        if self.path is None:
            from theta.git import repo as gitutil

            self.path = os.fspath(gitutil.scratch_dir(self.cwd, os.getppid()))
        return self.path


def _child(reader, file: Path, cwd: Path, w: int) -> None:
    from theta.commands.filter.receive import receive

    out = os.fdopen(w, "wb", buffering=0)  # each hash reaches the filter as it is taken
    chunks = reader.iter_content_views()
    end = {"path": None, "owned": False, "size": 0, "head": 0, "error": None, "changed": False}
    head = b""
    try:
        try:
            got = receive(chunks, _LazyDir(cwd), file, _Reporting(file.name, _member_ranges(file), out))
            end.update(path=os.fspath(got.path), owned=got.owned, size=got.size, head=len(got.head))
            head = got.head
        except (ProtocolError, EOFError):
            raise
        except Exception as e:  # refused: git's bytes must still all be read before the filter answers
            end.update(error=str(e) if isinstance(e, ThetaError) else f"{file.name}: {type(e).__name__}: {e}",
                       changed=isinstance(e, FileChanged))
            for _ in chunks:
                pass
    except (ProtocolError, EOFError) as e:  # (while receiving, or while draining after a refusal)
        out.write(b"P " + json.dumps(str(e) or "filter protocol: git's stream ended").encode() + b"\n")
        return
    left = reader.take_unread()
    end["left"] = len(left)
    out.write(b"E " + json.dumps(end).encode() + b"\n" + head + left)
