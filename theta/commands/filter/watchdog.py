"""A small process that says which checkpoints were left as placeholders when the process writing them is killed.

A process killed by the kernel (out of memory in its cgroup, kill -9) says nothing, and when it is theta's
filter or a hook whose exit status git ignores, the git command would end with exit 0 and the placeholders
unexplained. The writer therefore starts a watchdog first: a separate interpreter (``python -S``, the standard
library only: a few MiB, the last process an out-of-memory kill picks) that holds the read end of a pipe. The
writer sends each file's path when its checkpoint is in place, and a last line when it finishes normally. If
the pipe closes without it -- the writer died -- the watchdog removes the writer's temp files (and index.lock
while the writer held it) and prints, on the writer's stderr, one line per file not done: its name, that the process writing it was killed (for want of
memory when its memory cgroup counted an OOM kill meanwhile), and the command that completes the work.
"""
from __future__ import annotations

import json
import subprocess
import sys

_CODE = r"""
import json, os, shutil, signal, sys

signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the writer too: it reports for itself

def oom_kills():
    # the OOM-kill count of this process's memory cgroup (v2 memory.events, v1 memory.oom_control)
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctl, rel = line.split(":", 2)
        for base, name, ok in (("/sys/fs/cgroup", "memory.events", ctl == ""),
                               ("/sys/fs/cgroup/memory", "memory.oom_control", "memory" in ctl.split(","))):
            if not ok:
                continue
            try:
                for entry in open(base + rel + "/" + name).read().splitlines():
                    key, _, value = entry.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                pass
    return None

stdin = sys.stdin.buffer
first = stdin.readline()
try:
    todo, scratch, record = json.loads(first)
except ValueError:
    sys.exit(0)
before = oom_kills()
done, ended, lock = set(), False, None
for line in stdin:
    try:
        path = json.loads(line)
    except ValueError:
        break  # a line cut short: the writer died while sending it
    if path is None:
        ended = True
        break
    if isinstance(path, list):  # [index.lock's path, its inode] while the writer holds it, [null, 0] after
        lock = path if path[0] else None
        continue
    done.add(path)
if not ended:
    for d in scratch:  # the dead writer's temp files: nothing of it is left behind
        shutil.rmtree(d, ignore_errors=True)
    try:  # the index lock it held (its own file, by inode: never another git's)
        if lock is not None and os.stat(lock[0]).st_ino == lock[1]:
            os.unlink(lock[0])
    except OSError:
        pass
    after = oom_kills()
    why = ("the process writing it was killed for want of memory (an out-of-memory kill in its memory cgroup)"
           if before is not None and after is not None and after > before else
           "the process writing it was killed before it finished")  # (theta.commands.materialize.KILLED)
    left = [(path, command) for path, command in todo if path not in done]
    try:  # the record of what is left says why too (git theta status)
        with open(record, encoding="utf-8") as f:
            entries = json.load(f)
        for path, _ in left:
            if isinstance(entries.get(path), dict):
                entries[path]["why"] = why
        with open(record + ".watchdog", "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(record + ".watchdog", record)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    for path, command in left:
        os.write(2, ("git-theta: %s is a placeholder (%s); run `%s`\n" % (path, why, command))
                 .encode("utf-8", "surrogateescape"))
"""


class Watchdog:
    """Report the files not done if this process dies (see the module docstring). ``todo``: (path, the command
    that completes it) pairs; ``scratch``: directories of this process's temp files, removed if it dies;
    ``record``: the JSON file of what is left (theta.commands.handoff), whose entries for the files not done then
    say why. Use as a context manager; :meth:`done` after each file."""

    def __init__(self, todo: list[tuple[str, str]], scratch: list[str] = (), record: str = ""):
        self._proc = None
        if not todo:
            return
        try:
            self._proc = subprocess.Popen([sys.executable, "-S", "-c", _CODE], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, close_fds=True)
            self._send(json.dumps([todo, list(scratch), record]) + "\n")
        except OSError:
            self._proc = None  # no watchdog: the writer's own reports still cover every failure but a kill

    def _send(self, text: str) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(text.encode("utf-8", "surrogateescape"))
            self._proc.stdin.flush()
        except OSError:
            self._proc = None

    def done(self, path: str) -> None:
        self._send(json.dumps(path) + "\n")

    def locked(self, path: str | None, inode: int) -> None:
        """The writer now holds the lock file ``path`` (inode ``inode``; None: no longer): removed if it dies."""
        self._send(json.dumps([path, inode]) + "\n")

    def close(self) -> None:
        """The writer finished (or raised: then it reports for itself): the watchdog leaves silently."""
        if self._proc is None:
            return
        self._send("null\n")
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        self._proc.wait()
        self._proc = None

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
