"""theta.storage.store: git-lfs's own local layout (checked with the real git-lfs), dedup, integrity errors."""
import hashlib
import os
import subprocess

import pytest

from theta.base.errors import BlobCorruptError, BlobMissingError, StoreError
from theta.storage.store import BlobRef, LfsStore


def git(cwd, *args, **kw):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, **kw)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "lfs", "install", "--local")
    return r


def test_layout_and_ref(tmp_path):
    store = LfsStore(tmp_path / "objects")
    data = b"hello theta" * 100
    ref = store.put(data)
    oid = hashlib.sha256(data).hexdigest()
    assert ref == BlobRef(oid, len(data))
    p = tmp_path / "objects" / oid[:2] / oid[2:4] / oid
    assert store.path(ref) == p and p.read_bytes() == data
    assert store.has(ref) and store.get(ref) == data
    assert not [f for f in p.parent.iterdir() if f.name != oid]  # no temp files left behind
    assert not list((tmp_path / "tmp").iterdir())


def test_dedup_writes_once(tmp_path):
    store = LfsStore(tmp_path / "o")
    r1 = store.put(b"x" * 1000)
    inode = store.path(r1).stat().st_ino
    os.utime(store.path(r1), ns=(1, 1))
    r2 = store.put_chunks([b"x" * 400, memoryview(b"x" * 600)])
    assert r1 == r2 and store.written_objects == 1 and store.written_bytes == 1000
    assert store.path(r1).stat().st_ino == inode  # not rewritten...
    assert store.path(r1).stat().st_mtime_ns > 1  # ...but marked used (a concurrent prune leaves it)


def test_missing_and_corrupt(tmp_path):
    store = LfsStore(tmp_path / "o")
    ghost = BlobRef("ab" * 32, 10)
    assert not store.has(ghost)
    with pytest.raises(BlobMissingError, match=r"abab.*group 'enc\.w'.*file m\.pt|file m\.pt.*enc\.w"):
        store.get(ghost, group="enc.w", file="m.pt")
    ref = store.put(b"0123456789")
    store.path(ref).write_bytes(b"0123456780")
    assert store.get(ref) == b"0123456780"  # size only by default (readers check content hashes)
    with pytest.raises(BlobCorruptError, match="sha256"):
        LfsStore(store.objects_dir, verify=True).get(ref)
    store.path(ref).write_bytes(b"012")
    with pytest.raises(BlobCorruptError, match="3 bytes"):
        store.get(ref)
    assert store.missing([ghost, ghost, ref]) == [ghost, ref]  # wrong size counts as missing


def test_for_repo_outside_git(tmp_path):
    with pytest.raises(StoreError, match="not inside a git repository"):
        LfsStore.for_repo(tmp_path)


def test_real_git_lfs_reads_our_objects(repo):
    """`git lfs smudge` of a pointer resolves our object from the local store (no server involved)."""
    store = LfsStore.for_repo(repo)
    assert store.objects_dir == repo / ".git" / "lfs" / "objects"
    data = os.urandom(5000)
    ref = store.put(data)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{ref.oid}\nsize {ref.size}\n"
    out = git(repo, "lfs", "smudge", "f.bin", input=pointer.encode()).stdout
    assert out == data
    # and git-lfs's own pointer for the same bytes names the same oid
    (repo / "f.bin").write_bytes(data)
    ptr = git(repo, "lfs", "pointer", "--file", "f.bin").stdout.decode()
    assert f"oid sha256:{ref.oid}" in ptr and f"size {ref.size}" in ptr


def test_for_repo_honours_lfs_storage(repo, tmp_path):
    git(repo, "config", "lfs.storage", str(tmp_path / "elsewhere"))
    assert LfsStore.for_repo(repo).objects_dir == tmp_path / "elsewhere" / "objects"


def test_worktree_shares_the_common_store(repo):
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "init")
    git(repo, "worktree", "add", "-q", str(repo.parent / "wt"))
    assert LfsStore.for_repo(repo.parent / "wt").objects_dir == LfsStore.for_repo(repo).objects_dir


def test_put_stream_matches_put_and_dedups(tmp_path):
    store = LfsStore(tmp_path / "o")
    parts = [os.urandom(1000), b"", os.urandom(3000)]
    ref = store.put_stream(iter(parts))
    assert ref == BlobRef(hashlib.sha256(b"".join(parts)).hexdigest(), 4000)
    assert store.get(ref) == b"".join(parts)
    assert store.put_stream(iter(parts)) == ref == store.put(b"".join(parts))
    assert store.written_objects == 1 and not list((tmp_path / "tmp").iterdir())

    def failing():
        yield b"abc"
        raise RuntimeError("producer failed")
    with pytest.raises(RuntimeError):
        store.put_stream(failing())
    assert not list((tmp_path / "tmp").iterdir()) and store.written_objects == 1
