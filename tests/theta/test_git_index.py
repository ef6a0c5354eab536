"""theta/git/index.py against index files written by the real git: every version, SHA-256, long paths,
conflicts, racy entries, a held lock, a split index. git itself reads back what theta wrote."""
from __future__ import annotations

import os
import subprocess

import pytest

from theta.base.errors import IndexBusyError, IndexUnsupportedError
from theta.git import index


def git(repo, *args, input=None) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}
    return subprocess.run(["git", *args], cwd=repo, env=env, input=input, capture_output=True, check=True,
                          text=True).stdout


@pytest.fixture(params=["sha1", "sha256"])
def repo(tmp_path, request):
    r = tmp_path / "r"
    git(tmp_path, "init", "-q", f"--object-format={request.param}", str(r))
    for i in range(3):
        (r / f"d{i}").mkdir()
        (r / f"d{i}" / "f.txt").write_text(f"{i}\n")
    git(r, "add", ".")
    git(r, "commit", "-q", "-m", "x")
    long = "/".join(["y" * 200] * 25) + "/z"  # > 4095 bytes: the name length field saturates
    oid = git(r, "hash-object", "-w", "d0/f.txt").strip()
    git(r, "update-index", "--add", "--cacheinfo", f"100644,{oid},{long}")
    (r / "new.txt").write_text("n\n")
    git(r, "add", "-N", "new.txt")  # intent-to-add: an extended flag
    return r, request.param


def rewrite_same_content(path) -> os.stat_result:
    """New stat data for the same bytes (what theta does when it replaces a placeholder), dated 5 s back."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 5_000_000_000))
    return os.stat(path)


@pytest.mark.parametrize("version", [2, 3, 4])
def test_record_stat_makes_git_trust_the_file(repo, version):
    r, hash_name = repo
    git(r, "update-index", "--index-version", str(version))
    data = (r / ".git" / "index").read_bytes()
    v, entries = index.parse(data, hash_name)
    assert v == max(version, 3)  # intent-to-add needs version 3 at least
    by_path = {e.path: e for e in entries}
    assert len(entries) == 5 and any(len(p) > 4095 for p in by_path)
    oid = by_path["d1/f.txt"].oid
    assert oid == git(r, "rev-parse", ":d1/f.txt").strip()

    st = rewrite_same_content(r / "d1" / "f.txt")
    assert git(r, "diff-files", "--name-only", "d1") == "d1/f.txt\n"  # stat differs: git would re-read it
    assert index.record_stat(r / ".git" / "index", {"d1/f.txt": (oid, st)}, hash_name) == ["d1/f.txt"]
    assert git(r, "diff-files", "--name-only", "d1") == ""             # trusted without reading
    debug = git(r, "ls-files", "--debug", "d1/f.txt")
    assert f"mtime: {int(st.st_mtime)}:{st.st_mtime_ns % 10**9}" in debug and f"ino: {st.st_ino}" in debug
    assert "d1/f.txt" not in git(r, "status", "--porcelain")
    assert not (r / ".git" / "index.lock").exists()


def test_a_stale_blob_id_is_left_alone(repo):
    r, hash_name = repo
    st = rewrite_same_content(r / "d1" / "f.txt")
    before = (r / ".git" / "index").read_bytes()
    assert index.record_stat(r / ".git" / "index", {"d1/f.txt": ("0" * len(index.parse(before, hash_name)[1][0].oid),
                                                                 st)}, hash_name) == []
    assert (r / ".git" / "index").read_bytes() == before


def test_racily_clean_entries_are_smudged_like_git_does(repo):
    r, hash_name = repo
    data = (r / ".git" / "index").read_bytes()
    entries = {e.path: e for e in index.parse(data, hash_name)[1]}
    st = rewrite_same_content(r / "d1" / "f.txt")
    mtime_d2 = entries["d2/f.txt"].stat[2]
    new, done = index.patched(data, {"d1/f.txt": (entries["d1/f.txt"].oid, st)}, hash_name, racy_from=mtime_d2)
    after = {e.path: e for e in index.parse(new, hash_name)[1]}
    assert done == ["d1/f.txt"]
    assert after["d2/f.txt"].stat[9] == 0          # same second as the old index: content must be re-checked
    assert after["d1/f.txt"].stat[9] == st.st_size
    assert after["d2/f.txt"].oid == entries["d2/f.txt"].oid


def test_a_held_lock_is_respected(repo):
    r, hash_name = repo
    st = rewrite_same_content(r / "d1" / "f.txt")
    oid = git(r, "rev-parse", ":d1/f.txt").strip()
    (r / ".git" / "index.lock").write_bytes(b"")
    before = (r / ".git" / "index").read_bytes()
    with pytest.raises(IndexBusyError, match="index.lock exists"):
        index.record_stat(r / ".git" / "index", {"d1/f.txt": (oid, st)}, hash_name)
    assert (r / ".git" / "index").read_bytes() == before
    assert (r / ".git" / "index.lock").read_bytes() == b""  # git's lock, untouched


def test_split_index_and_garbage_are_refused(repo, tmp_path):
    r, hash_name = repo
    git(r, "update-index", "--split-index")
    with pytest.raises(IndexUnsupportedError, match="split index"):
        index.parse((r / ".git" / "index").read_bytes(), hash_name)
    for bad in (b"", b"DIRC\0\0\0\x09\0\0\0\0" + b"\0" * 32, b"XXXX" + b"\0" * 40):
        with pytest.raises(IndexUnsupportedError):
            index.parse(bad, hash_name)
    truncated = (r / ".git" / "index").read_bytes()[:40] + b"\0" * 40
    with pytest.raises(IndexUnsupportedError):
        index.parse(b"DIRC\0\0\0\x02\0\0\0\x05" + truncated[12:60], hash_name)


def test_unmerged_entries_keep_their_stages(tmp_path):
    r = tmp_path / "m"
    git(tmp_path, "init", "-q", "-b", "main", str(r))
    (r / "a.txt").write_text("base\n")
    git(r, "add", ".")
    git(r, "commit", "-q", "-m", "base")
    git(r, "checkout", "-q", "-b", "side")
    (r / "a.txt").write_text("side\n")
    git(r, "commit", "-q", "-am", "side")
    git(r, "checkout", "-q", "main")
    (r / "a.txt").write_text("main\n")
    git(r, "commit", "-q", "-am", "main")
    subprocess.run(["git", "merge", "side"], cwd=r, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"})
    _, entries = index.parse((r / ".git" / "index").read_bytes())
    assert sorted((e.path, e.stage) for e in entries) == [("a.txt", 1), ("a.txt", 2), ("a.txt", 3)]
    st = os.stat(r / "a.txt")
    assert index.record_stat(r / ".git" / "index", {"a.txt": (entries[1].oid, st)}) == []  # only stage 0


@pytest.mark.parametrize("argv,cmd", [
    (["git", "-C", "x", "-c", "a=b", "checkout", "main"], "checkout"),
    (["/usr/bin/git", "--git-dir", ".git", "--no-pager", "archive", "HEAD"], "archive"),
    (["git", "-P", "cat-file", "--filters", "HEAD:m.pt"], "cat-file"),
    (["/usr/lib/git-core/git-archive", "HEAD"], "archive"),
    (["git-theta", "filter-process"], None), (["sh", "-c", "git-theta filter-process"], None), (["git"], None), ([], None),
])
def test_the_git_subcommand_from_a_command_line(argv, cmd):
    from theta.git.repo import git_subcommand

    assert git_subcommand(argv) == cmd


def test_the_invoking_git_subcommand_is_found_through_proc_as_psutil_finds_it(tmp_path):
    """A process git starts through its shell (as it starts the filter) finds git's subcommand from /proc,
    and psutil's walk up the same processes agrees."""
    import os
    import subprocess
    import sys

    probe = ("import psutil, theta.git.repo as r; from theta.git.repo import git_subcommand as g\n"
             "p = psutil.Process().parent(); walk = []\n"
             "while p is not None and len(walk) < 4: walk.append(g(p.cmdline())); p = p.parent()\n"
             "print(r.invoking_subcommand(), next((c for c in walk if c), None))")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": str(tmp_path / "none"),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(["git", "-c", f"alias.probe=!{sys.executable} {script}", "probe"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["probe", "probe"]
