"""The placeholders' hand-over between the filter and the hooks (theta.commands.filter.handoff), and the watchdog
that names the files a killed writer left (theta.commands.filter.watchdog): real git for the git directory, a
real process killed with SIGKILL."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from theta.commands.filter import handoff
from theta.commands.filter.watchdog import Watchdog

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    return tmp_path / "r"


def test_a_hook_takes_every_ledger_once_and_the_filter_sees_it(repo):
    ledger = handoff.Ledger(repo)
    ledger.add("model/a.safetensors", "1" * 40, 5)
    ledger.add("model/b.safetensors", "2" * 40, 6)
    ledger.add("model/a.safetensors", "3" * 40, 7)  # handed again later in the command: the last one counts
    assert not ledger.taken()
    taken = handoff.take(repo)
    assert sorted((r["path"], r["oid"], r["issued_ns"]) for r in taken) == [
        ("model/a.safetensors", "3" * 40, 7), ("model/b.safetensors", "2" * 40, 6)]
    assert ledger.taken() and handoff.take(repo) == []
    assert not list(handoff.state_dir(repo).iterdir())  # nothing left behind


def test_a_line_cut_short_by_a_kill_is_skipped(repo):
    d = handoff.state_dir(repo)
    (d / "handed-99999").write_text('{"path": "a.pt", "oid": "' + "1" * 40 + '", "issued_ns": 1}\n{"path": "b.p')
    assert [r["path"] for r in handoff.take(repo)] == ["a.pt"]


def test_the_record_of_what_is_left(repo):
    handoff.note(repo, {"a.pt": ("1" * 40, "No space left on device"), "b.pt": ("2" * 40, "interrupted")})
    assert handoff.left(repo) == {"a.pt": {"oid": "1" * 40, "why": "No space left on device"},
                                  "b.pt": {"oid": "2" * 40, "why": "interrupted"}}
    handoff.note(repo, {"a.pt": None})
    assert list(handoff.left(repo)) == ["b.pt"]
    handoff.note(repo, {"b.pt": None})
    assert handoff.left(repo) == {} and not handoff.record_path(repo).exists()
    handoff.record_path(repo).write_text("[not, json")  # a broken record is no record
    assert handoff.left(repo) == {}


WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from theta.commands.filter.watchdog import Watchdog
    scratch, record = sys.argv[1], sys.argv[2]
    os.makedirs(scratch)
    open(os.path.join(scratch, "half-written"), "wb").write(b"x" * 1000)
    dog = Watchdog([("a.pt", "git theta checkout a.pt"), ("b\\nc.pt", "git theta checkout 'b\\nc.pt'")],
                   [scratch], record)
    dog.done("a.pt")
    lock = os.path.join(os.path.dirname(record), "index.lock")
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    dog.locked(lock, os.fstat(fd).st_ino)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os.unlink(lock)
    dog.locked(None, 0)
    dog.close()
""")


@pytest.mark.parametrize("end", ["kill", "finish"])
def test_the_watchdog_names_what_a_killed_writer_left(tmp_path, end):
    scratch, record = tmp_path / "materialize-1", tmp_path / "placeholders.json"
    record.write_text(json.dumps({"a.pt": {"oid": "1" * 40, "why": "x"}, "b\nc.pt": {"oid": "2" * 40, "why": "x"}}))
    proc = subprocess.run([sys.executable, "-c", WRITER.format(root=str(ROOT)), str(scratch), str(record), end],
                          capture_output=True, timeout=60)
    err = proc.stderr.decode()
    if end == "finish":
        assert proc.returncode == 0 and err == ""
        assert scratch.exists()  # the writer's own to remove
        assert not (tmp_path / "index.lock").exists()
        return
    assert proc.returncode == -signal.SIGKILL
    # (the watchdog held the writer's stderr: run() returned once it had written its line and exited)
    assert err == ("git-theta: b\nc.pt is a placeholder (the process writing it was killed before it finished); "
                   "run `git theta checkout 'b\nc.pt'`\n")
    assert not scratch.exists()
    assert not (tmp_path / "index.lock").exists()  # the lock it held: removed (its inode was the writer's)
    entries = json.loads(record.read_text())
    assert entries["b\nc.pt"]["why"] == "the process writing it was killed before it finished"
    assert entries["a.pt"]["why"] == "x"  # done: not the watchdog's to say


def test_no_watchdog_without_files():
    with Watchdog([]) as dog:
        dog.done("a.pt")  # nothing to report to: a no-op
