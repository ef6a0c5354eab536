"""theta.storage.prefetch's records, as a reader sees them: a download runs while the process it was started
in holds the record's lock, however it ends; a record is seen only complete; the records of starters that are
gone are removed, a living starter's are left to it. (A real clone through the filter's early download, and a
failed one refetched, are tests/e2e/test_transfer.py's.)"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess

from support.gitrepo import GitEnv

from theta.storage import prefetch


def oid(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _record(folder, name: str, oids: list[str]) -> int:
    """A record written as prefetch.start writes it: locked, complete, then named; returns the locked fd."""
    fd = os.open(folder / f".{name}.tmp", os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"oids": oids}).encode())
    os.rename(folder / f".{name}.tmp", folder / name)
    return fd


def test_records_say_which_downloads_run_and_forget_those_of_gone_starters(tmp_path):
    genv = GitEnv.create(tmp_path)
    repo = genv.init("repo")
    folder = repo.git_common_dir() / "theta" / prefetch.RECORDS
    folder.mkdir(parents=True)
    dead = _gone_pid()

    fd = _record(folder, f"{os.getpid()}-0.json", [oid(1), oid(2)])
    child = subprocess.Popen(["sleep", "30"], pass_fds=(fd,))  # holds the lock as git-lfs would
    os.close(fd)
    try:
        (folder / f".{os.getpid()}-1.json.tmp").write_text(json.dumps({"oids": [oid(3)]}))  # being written
        (folder / f"{os.getpid()}-2.json").write_text("{not json")                          # not ours to read
        os.close(_record(folder, f"{dead}-0.json", [oid(4)]))  # its starter and its git-lfs are gone

        seen = prefetch.records(repo.path)
        assert [s.oids for s in seen] == [{oid(1), oid(2)}]
        assert not seen[0].ended()
        assert not (folder / f"{dead}-0.json").exists()  # removed: nobody else would
    finally:
        child.kill()
        child.wait()
    assert seen[0].ended()  # the lock went with the process, killed or not
    again = prefetch.records(repo.path)
    assert [s.oids for s in again] == [{oid(1), oid(2)}] and again[0].ended()  # its starter lives: left to it
    for s in seen + again:
        s.close()


def _gone_pid() -> int:
    """The pid of a process that has ended."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
