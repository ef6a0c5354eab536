"""git's long-running filter process (gitattributes(5), "Long Running Filter Process"), protocol version 2.

One `git-theta filter-process` serves a whole `git add` / `git checkout`. stdout carries protocol data only;
messages go to stderr. The requests are answered by :class:`theta.commands.filter.session.Filter`.

Any failure answers ``status=error``: before any content byte when it can (missing blobs, bad metadata),
else after the partial content, which the protocol allows and which makes git discard that content (a group
whose rebuilt value does not match its content hash is found while the next is written). Either way git
leaves the index and the working tree file untouched (``filter.theta.required=true`` makes git stop).
"""
from __future__ import annotations

import os
import sys
from typing import BinaryIO

from theta import settings
from theta.base.errors import ProtocolError, ThetaError
from theta.base.malloc import give_back_freed_memory
from theta.commands.filter.messages import report_error
from theta.commands.filter.session import Filter
from theta.git import repo as gitutil
from theta.git.pktline import PktReader, PktWriter, grow_pipe


_PIPE_BYTES = 1 << 20


def _grow_pipes(*streams: BinaryIO) -> None:
    """Ask for 1 MiB pipe buffers to and from git (Linux; default 64 KiB, one packet): git and the filter
    then block on each other ~16x less often while a checkpoint streams through. Best effort."""
    if settings.env("PIPE_SIZE") == "0":
        return
    for s in streams:
        try:
            grow_pipe(s.fileno(), _PIPE_BYTES)
        except (OSError, ValueError, AttributeError):
            pass  # no file descriptor (a test's stream)


def serve(stdin: BinaryIO, stdout: BinaryIO, cwd: str | os.PathLike = ".") -> int:
    _grow_pipes(stdin, stdout)
    r, w = PktReader(stdin, _PIPE_BYTES), PktWriter(stdout)  # (reads a pipe's worth at a time)
    hello = r.read_text_list()
    if hello[:1] != ["git-filter-client"] or "version=2" not in hello[1:]:
        raise ProtocolError(f"filter protocol: unexpected greeting {hello!r}")
    w.text_list(["git-filter-server", "version=2"])
    caps = r.read_text_list()
    offered = ["capability=clean", "capability=smudge"]
    if settings.env("DELAY", "1") != "0":
        offered.append("capability=delay")  # batch the downloads of a whole checkout (see Filter.available)
    w.text_list([c for c in offered if c in caps])

    # one git config -l and one rev-parse instead of one process per read, run while the hook check's modules
    # (numpy) are imported
    from theta.base import parallel

    remembering = parallel.pool("start").submit(gitutil.remember_reads, cwd)
    from theta.commands.hooks import ensure_installed_quietly
    from theta.base.errors import GitError

    try:
        remembering.result()
    except GitError:
        pass  # not a repository: Filter() below says so in its own words
    ensure_installed_quietly(cwd)
    filt = Filter(cwd)
    while True:
        try:
            header = r.read_pairs()
        except EOFError:
            filt.finish()
            filt.close()
            if stdin is getattr(sys.stdin, "buffer", None):
                _exit_now()
            return 0
        command, path = header.get("command"), header.get("pathname", "")
        if command == "list_available_blobs":  # no content section
            try:
                paths = filt.available()
            except Exception as e:  # answer git rather than die: it then reports the files as missing
                report_error("", command, e)
                paths = []
            w.text_list([f"pathname={p}" for p in paths])
            w.text_list(["status=success"])
            continue
        chunks = r.iter_content_views()  # (each consumed before the next: receive and _spool_all)
        content = None  # the content section being streamed to git, if one was started
        try:
            if command == "clean":
                data = filt.clean(path, chunks)
                w.text_list(["status=success"])
                if data:
                    w.packet(data)
                w.flush()
            elif command == "smudge":
                def send(f):  # a file rebuilt completely (and checked) before status=success goes out
                    w.text_list(["status=success"])
                    w.content_from(f)

                def open_content():  # streamed: content packets go out while the file is rebuilt
                    nonlocal content
                    w.text_list(["status=success"])
                    content = w.content()
                    return content
                if filt.smudge(path, chunks, send, can_delay=header.get("can-delay") == "1",
                               stream=open_content, blob=header.get("blob")):
                    w.text_list(["status=delayed"])
                    continue
                if content is not None:
                    content.close()
                    content = None
            else:
                for _ in chunks:
                    pass
                raise ThetaError(f"unsupported filter command {command!r}")
            w.flush()  # empty list: keep status=success
        except ProtocolError:
            filt.close()  # git's stream is broken: this process ends, and leaves no scratch directory
            raise
        except Exception as e:  # report any failure to git as status=error for this file, keep serving
            for _ in chunks:  # drain whatever git still sends for this file
                pass
            report_error(path, command, e)
            if content is not None:  # content (partly) sent: end it; the error then makes git drop it
                content.close()
            w.text_list(["status=error"])
        # git may keep this process waiting while other processes work (a stash runs update-index, whose own
        # filter cleans the next file): what this file's work freed goes back to the kernel, so two filters'
        # kept heaps never add up in a small container (theta.base.malloc)
        give_back_freed_memory()


def _exit_now() -> None:
    """git closed our stdin: every request was answered. Leave without the interpreter's teardown (freeing
    every module and joining idle pools costs ~0.1 s, which git waits for at the end of each add/checkout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


