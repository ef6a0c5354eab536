"""theta.commands.filter.forked_receive: a real forked child receives git's packets from a real pipe while the
filter would import; every member's hash reaches the groups whose range it is, a member no group took is
checked against the file, other bytes are spooled exactly, and what the child read past the content is
handed back to the filter's reader."""
import os
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import xxhash

from theta.base import parallel, scratch
from theta.commands.filter import forked_receive
from theta.base.errors import FileChanged
from theta.git.pktline import PktReader, PktWriter
from theta.model.git_bytes import GroupHashes


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def make_zip(path, sizes=(300_000, 5, 1_000_000, 70_000)):
    """A stored zip like torch's: members of random bytes; returns (bytes, [(start, end)] of each member)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for i, n in enumerate(sizes):
            z.writestr(f"archive/data/{i}", os.urandom(n))
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        ranges = []
        for info in z.infolist():
            start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
            ranges.append((start, start + info.compress_size))
    return data, ranges


def git_sends(content: bytes, after: bytes = b""):
    """A pipe carrying ``content`` as git's packets, a flush, then ``after`` (the next request), written by a
    thread; returns the read end's stream."""
    r, w = os.pipe()

    def write():
        try:
            with os.fdopen(w, "wb") as out:
                pw = PktWriter(out)
                for i in range(0, len(content), 65516):
                    pw.packet(content[i:i + 65516])
                pw.flush()
                out.write(after)
        except BrokenPipeError:
            pass  # (a test whose receiver stopped reading)
    threading.Thread(target=write, daemon=True).start()
    return os.fdopen(r, "rb")


def receive_forked(repo, sent: bytes, hashes, after: bytes = b""):
    file = repo / "model.pt"
    stream = git_sends(sent, after)
    reader = PktReader(stream)
    child = forked_receive.start(reader, file, repo)
    return child.received(file, hashes), reader, stream


def test_every_member_hash_reaches_its_group_and_the_next_request_is_handed_back(repo):
    data, members = make_zip(repo / "model.pt")
    groups = [(s, e, f"g{i}") for i, (s, e) in enumerate(members) if i != 2]  # member 2: no group's
    hashes = GroupHashes("model.pt")
    hashes.expect(groups + [(members[2][0] + 10, members[2][0] + 20, "inside")])  # a range inside member 2
    nxt = b"%04x" % (4 + len(b"command=smudge\n")) + b"command=smudge\n0000"
    got, reader, stream = receive_forked(repo, data, hashes, after=nxt)
    assert not got.owned and got.path == repo / "model.pt" and got.size == len(data)
    assert got.head == data[:4096]
    for s, e, k in groups:
        assert hashes.hash_of(k) == xxhash.xxh3_128_hexdigest(data[s:e]), k
    assert hashes.hash_of("inside") is None  # no member is its range: the clean hashes the file's bytes
    assert reader.read_pairs() == {"command": "smudge"}  # read by the child or not, it comes next
    stream.close()


def test_a_member_no_group_took_is_checked_against_the_file(repo):
    data, members = make_zip(repo / "model.pt")
    s, e = members[2]
    sent = bytearray(data)
    sent[(s + e) // 2] ^= 1  # git sent other bytes there: only their hash was kept
    with pytest.raises(FileChanged, match=r"model.pt: the file changed while git was reading it"):
        receive_forked(repo, bytes(sent), None)
    hashes = GroupHashes("model.pt")  # the same member taken by a group: the clean reading it finds it
    hashes.expect([(s, e, "g")])
    got, _, stream = receive_forked(repo, bytes(sent), hashes)
    assert not got.owned and hashes.hash_of("g") == xxhash.xxh3_128_hexdigest(bytes(sent[s:e]))
    with pytest.raises(FileChanged, match=r"group 'g' changed"):
        hashes.check("g", xxhash.xxh3_128_hexdigest(data[s:e]))
    stream.close()


@pytest.mark.parametrize("where", ["header", "longer", "shorter"])
def test_other_bytes_than_the_files_are_spooled_exactly_in_the_filters_scratch_dir(repo, where):
    data, members = make_zip(repo / "model.pt")
    sent = bytearray(data)
    if where == "header":
        sent[members[1][0] - 3] ^= 1  # in a local header (compared, not hashed)
    elif where == "longer":
        sent += b"more"
    else:
        sent = sent[:members[2][0] + 100]
    got, _, stream = receive_forked(repo, bytes(sent), None)
    assert got.owned and got.path.read_bytes() == bytes(sent) and got.size == len(sent)
    assert got.path.parent.name == scratch.owner_tag()  # this process's own: swept once it is gone
    got.cleanup()
    assert not got.path.exists()
    stream.close()


def test_a_hashed_member_git_sent_otherwise_is_refused_when_a_later_difference_forces_a_spool(repo):
    """Only the member's hash was kept, so a spool cannot hold git's bytes of it: refused, naming the file."""
    data, members = make_zip(repo / "model.pt")
    sent = bytearray(data)
    sent[members[3][0] + 7] ^= 1
    sent[len(data) - 5] ^= 1  # the central directory: compared, and the spool starts there
    with pytest.raises(FileChanged, match=r"model.pt: the file changed while git was reading it"):
        receive_forked(repo, bytes(sent), None)
    assert os.listdir(repo / ".git" / "theta" / "tmp" / scratch.owner_tag()) == []


def test_a_killed_child_is_a_protocol_error_not_a_hang(repo, monkeypatch):
    from theta.base.errors import ProtocolError

    data, _ = make_zip(repo / "model.pt")
    monkeypatch.setattr(forked_receive.faults, "_SPEC", "receive:forked")
    monkeypatch.setattr(forked_receive.faults, "_NAME", "receive:forked")
    with pytest.raises(ProtocolError, match="ended without an answer"):
        receive_forked(repo, data, None)


def test_only_a_clean_of_a_zip_with_threads_is_received_by_a_child(repo, monkeypatch):
    make_zip(repo / "model.pt")
    (repo / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    clean = {"command": "clean", "pathname": "model.pt"}
    monkeypatch.setattr(parallel, "CODEC_THREADS", 2)
    monkeypatch.delenv("GIT_THETA_SPOOL", raising=False)
    assert forked_receive.wanted(clean, repo) == repo / "model.pt"
    assert forked_receive.wanted({"command": "smudge", "pathname": "model.pt"}, repo) is None
    assert forked_receive.wanted({"command": "clean", "pathname": "model.safetensors"}, repo) is None
    assert forked_receive.wanted({"command": "clean", "pathname": "gone.pt"}, repo) is None
    monkeypatch.setenv("GIT_THETA_FORK_RECEIVE", "0")
    assert forked_receive.wanted(clean, repo) is None
    monkeypatch.delenv("GIT_THETA_FORK_RECEIVE")
    monkeypatch.setattr(parallel, "CODEC_THREADS", 1)
    assert forked_receive.wanted(clean, repo) is None


def test_the_child_is_named_for_ps_and_the_benchmark(repo):
    """The benchmark counts the child's own pages (USS) by this name (scripts/bench/harness.py)."""
    data, _ = make_zip(repo / "model.pt")
    r, w = os.pipe()
    reader = PktReader(os.fdopen(r, "rb"))
    child = forked_receive.start(reader, repo / "model.pt", repo)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/comm").read_text().strip() != forked_receive.NAME:
        assert time.monotonic() < deadline, "the child never took its name"
        time.sleep(0.005)
    with os.fdopen(w, "wb") as out:
        pw = PktWriter(out)
        pw.packet(data)
        pw.flush()
    got = child.received(repo / "model.pt", None)
    assert not got.owned and got.size == len(data)
