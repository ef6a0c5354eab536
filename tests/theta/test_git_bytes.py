"""theta.model.git_bytes with commands.receive: the groups' byte ranges of git's content are hashed as they arrive
instead of compared with the work-tree file; everything else is still compared; a difference anywhere is
either spooled exactly (git's bytes kept) or refused naming the file (git's bytes of a group are gone)."""
import os
import threading

import pytest
import xxhash

from theta.commands.filter import receive as receiving
from theta.commands.filter.receive import receive
from theta.base.errors import FileChanged
from theta.model.git_bytes import GroupHashes


@pytest.fixture(autouse=True)
def small_window(monkeypatch):
    # windows smaller than git's packets and not a multiple of them: every refill path runs
    monkeypatch.setattr(receiving, "_COMPARE_BLOCK", 100_000)


RANGES = [(1000, 150_000, "a"), (150_100, 150_101, "b"), (150_101, 420_000, "c"), (500_000, 700_000, "d")]
SIZE = 800_000


def packets(b: bytes, size: int):
    return iter([b[i:i + size] for i in range(0, len(b), size)])


def laid_out(ranges=RANGES, delay: float = 0.0) -> GroupHashes:
    """A GroupHashes whose layout a "clean" thread publishes after ``delay`` seconds."""
    h = GroupHashes("model.pt")
    t = threading.Timer(delay, h.expect, args=(ranges,))
    t.start()
    return h


@pytest.mark.parametrize("packet", [1000, 65516, 250_000])
def test_the_same_bytes_use_the_file_and_hash_each_range(tmp_path, packet):
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    h = laid_out(delay=0.05)
    got = receive(packets(data, packet), tmp_path, f, h)
    assert not got.owned and got.path == f and got.size == SIZE and got.head == data[:4096]
    for s, e, k in RANGES:
        assert h.hash_of(k) == xxhash.xxh3_128_hexdigest(data[s:e]), k
        h.check(k, xxhash.xxh3_128_hexdigest(data[s:e]))  # the file's bytes are git's: no error


def test_a_difference_outside_the_groups_spools_exactly_gits_bytes(tmp_path):
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    for where in (10, 150_050, 450_000, SIZE - 1):  # before, between and after the ranges
        other = bytearray(data)
        other[where] ^= 0xFF
        got = receive(packets(bytes(other), 65516), tmp_path, f, laid_out())
        assert got.owned and got.path.read_bytes() == other
        got.cleanup()
    for other in (data + b"x", data[:-1], data[:300_000], data[:150_000]):  # longer; shorter (in a gap, a group)
        got = receive(packets(other, 65516), tmp_path, f, laid_out())
        assert got.owned and got.path.read_bytes() == other, len(other)
        got.cleanup()
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_group_git_sent_otherwise_is_refused_by_the_clean_that_reads_it(tmp_path):
    """Only the hash of git's bytes of a group is kept: the work-tree file is "the content" as far as the
    receiving can tell, and the clean reading that group from the file finds the difference."""
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    other = bytearray(data)
    other[200_000] ^= 1  # inside group "c"
    h = laid_out()
    got = receive(packets(bytes(other), 65516), tmp_path, f, h)
    assert not got.owned
    assert h.hash_of("c") == xxhash.xxh3_128_hexdigest(bytes(other[150_101:420_000]))
    with pytest.raises(FileChanged, match=r"model.pt: group 'c' changed while git was reading the file"):
        h.check("c", xxhash.xxh3_128_hexdigest(data[150_101:420_000]))


def test_when_a_later_difference_forces_a_spool_a_hashed_group_is_checked_against_the_file(tmp_path):
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    other = bytearray(data)
    other[200_000] ^= 1   # inside group "c": only hashed
    other[450_000] ^= 1   # between groups: compared, so git's bytes from here on are spooled
    with pytest.raises(FileChanged, match="model.pt: the file changed while git was reading it"):
        receive(packets(bytes(other), 65516), tmp_path, f, laid_out())
    assert os.listdir(tmp_path) == ["model.pt"]  # no spool left
    shorter = bytes(other[:300_000])  # git's content ends inside group "c", after its difference
    with pytest.raises(FileChanged):
        receive(packets(shorter, 65516), tmp_path, f, laid_out())
    assert os.listdir(tmp_path) == ["model.pt"]


def test_overlapping_ranges_are_compared_and_a_late_layout_is_ignored(tmp_path):
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    h = GroupHashes("model.pt")
    taken = h.expect([(1000, 5000, "x"), (4000, 9000, "y"), (20_000, 30_000, "z"), (40_000, 40_000, "empty")])
    assert taken == {"z"}
    got = receive(packets(data, 65516), tmp_path, f, h)
    assert not got.owned and h.hash_of("x") is None and h.hash_of("z") == xxhash.xxh3_128_hexdigest(data[20_000:30_000])

    h = GroupHashes("model.pt")
    assert h.layout(timeout=0.01) == []  # the clean never laid out: every byte is compared
    assert h.expect(RANGES) == set()
    other = bytearray(data)
    other[200_000] ^= 1
    got = receive(packets(bytes(other), 65516), tmp_path, f, h)
    assert got.owned and got.path.read_bytes() == other
    got.cleanup()


def test_the_clean_waiting_for_a_hash_is_woken_when_the_receiving_fails(tmp_path):
    data = os.urandom(SIZE)
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    h = laid_out()

    def broken():
        yield data[:1000]
        raise OSError("git went away")

    waiter = []
    t = threading.Thread(target=lambda: waiter.append(h.hash_of("d")))
    t.start()
    with pytest.raises(OSError):
        receive(broken(), tmp_path, f, h)
    t.join(5)
    assert not t.is_alive() and waiter == [None]


def test_a_file_that_is_no_checkpoint_tells_the_receiving_at_once(tmp_path):
    """The clean of a file theta cannot read as a checkpoint says there is nothing to hash as soon as it fails
    to open it, before the caller stores it as one opaque blob: git's bytes are compared from then on."""
    from theta.model.clean import clean_checkpoint
    from theta.base.errors import NotCheckpointError
    from theta.storage.store import LfsStore

    f = tmp_path / "README.md"
    f.write_bytes(b"# not a checkpoint\n" * 1000)
    h = GroupHashes("README.md")
    with pytest.raises(NotCheckpointError):
        clean_checkpoint(f, LfsStore(tmp_path / "objects"), git_bytes=h)
    assert h.decided and h.layout(timeout=0) == []
