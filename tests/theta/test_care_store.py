"""theta's protected second name for each blob (<lfs>/theta-objects): what `git lfs prune` cannot reach.

Unit level, on the file system (the e2e tests run the real `git lfs prune` against it)."""
import errno
import hashlib
import os

import pytest

from theta.storage.store import KEEP_DIR, QUARANTINE_DIR, BlobRef, LfsStore


@pytest.fixture
def store(tmp_path):
    lfs = tmp_path / "lfs"
    return LfsStore(lfs / "objects", keep_dir=lfs / KEEP_DIR)


def same_file(a, b) -> bool:
    return os.path.samefile(a, b)


def test_put_gives_two_names_to_one_file(store):
    data = os.urandom(3000)
    ref = store.put(data)
    assert ref.oid == hashlib.sha256(data).hexdigest()
    assert same_file(store.path(ref), store.keep_path(ref)) and store.path(ref).stat().st_nlink == 2
    assert list(store.kept()) == [ref]


def test_a_pruned_git_lfs_name_comes_back_and_reads_never_fail(store):
    ref = store.put(b"abc" * 1000)
    os.unlink(store.path(ref))             # what `git lfs prune` does
    assert store.get(ref) == b"abc" * 1000  # read through theta's name...
    assert same_file(store.path(ref), store.keep_path(ref))  # ...which also restored git-lfs's
    os.unlink(store.path(ref))
    with store.mapped(ref) as view:
        assert bytes(view) == b"abc" * 1000
    os.unlink(store.path(ref))
    assert store.has(ref) and same_file(store.path(ref), store.keep_path(ref))
    assert store.missing([ref]) == []


def test_a_blob_only_git_lfs_holds_is_adopted(store):
    data = b"written by git-lfs or by a theta without protection"
    ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
    store.path(ref).parent.mkdir(parents=True)
    store.path(ref).write_bytes(data)
    assert not store.keep_path(ref).exists()
    assert store.has(ref)
    assert same_file(store.path(ref), store.keep_path(ref))


def test_wrong_size_is_not_has_and_not_adopted(store):
    ref = BlobRef("ab" * 32, 10)
    store.path(ref).parent.mkdir(parents=True)
    store.path(ref).write_bytes(b"123")
    assert not store.has(ref) and not store.keep_path(ref).exists()


def test_remove_frees_the_bytes_once_and_both_names(store):
    ref = store.put(b"x" * 5000)
    assert store.remove(ref) == 5000
    assert not store.path(ref).exists() and not store.keep_path(ref).exists()
    assert store.remove(ref) == 0 and not store.has(ref)


def test_quarantine_moves_the_bad_copy_aside(store):
    ref = store.put(b"good bytes" * 10)
    store.path(ref).write_bytes(b"bad! bytes" * 10)  # same inode: both names see it
    q = store.quarantine(ref)
    assert q == store.objects_dir.parent / QUARANTINE_DIR / ref.oid and q.read_bytes() == b"bad! bytes" * 10
    assert not store.path(ref).exists() and not store.keep_path(ref).exists()
    assert store.put(b"good bytes" * 10) == ref
    store.path(ref).write_bytes(b"worse bytes" * 10)
    assert store.quarantine(ref).name == f"{ref.oid}.1"  # an earlier quarantined copy is kept
    assert store.quarantine(BlobRef("cd" * 32, 1)) is None


def test_duplicated_names_are_relinked_only_when_both_copies_are_right(store):
    data = os.urandom(4096)
    ref = store.put(data)
    os.unlink(store.path(ref))
    store.path(ref).write_bytes(data)  # a separate copy (e.g. `cp -r` of the repository)
    assert store.is_duplicated(ref)
    assert store.relink(ref) == 4096 and not store.is_duplicated(ref)
    assert same_file(store.path(ref), store.keep_path(ref))
    os.unlink(store.path(ref))
    store.path(ref).write_bytes(b"\0" * 4096)  # a corrupt copy: never spread over the good one
    assert store.relink(ref) == 0 and store.is_duplicated(ref)
    assert store.keep_path(ref).read_bytes() == data


def test_without_hard_links_the_second_name_is_a_copy(store, monkeypatch, capsys):
    """A file system without hard links (link() fails with EPERM or EXDEV): a copy, and one warning."""
    def no_link(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # such file systems have no unnamed temp files either
    a = store.put(b"a" * 100)
    b = store.put(b"b" * 100)
    assert store.keep_path(a).read_bytes() == b"a" * 100 and not same_file(store.path(a), store.keep_path(a))
    assert store.keep_path(b).read_bytes() == b"b" * 100
    assert capsys.readouterr().err.count("cannot hard-link") == 1
    os.unlink(store.path(a))
    assert store.get(a) == b"a" * 100 and store.path(a).exists()


def test_a_store_without_keep_dir_behaves_as_before(tmp_path):
    plain = LfsStore(tmp_path / "objects")
    ref = plain.put(b"q" * 10)
    assert plain.keep_path(ref) is None and list(plain.kept()) == []
    os.unlink(plain.path(ref))
    assert not plain.has(ref)
