"""theta.git.lfs.adopt_partials: the partial downloads a killed git-lfs left under ``lfs/incomplete`` (named
``<oid><random digits>``) become ``<oid>.part``, the name git-lfs 3 resumes from -- the largest one, when no
process has it open and there is no ``.part`` already; the other leftovers of the object go. (The whole story,
a real git-lfs killed with -9 while a real server sends, is tests/e2e/test_transfer.py's slow test.)"""
from __future__ import annotations

import hashlib

from theta.git.lfs import adopt_partials


def oid(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def test_a_killed_downloads_partial_files_become_resumable(tmp_path):
    inc = tmp_path / "incomplete"
    inc.mkdir()
    a, b, c, d, other = oid(1), oid(2), oid(3), oid(4), oid(5)
    (inc / f"{a}123").write_bytes(b"x" * 10)
    (inc / f"{a}456").write_bytes(b"x" * 30)      # the largest of a's leftovers: kept
    (inc / f"{b}789").write_bytes(b"")            # nothing downloaded: removed, not adopted
    (inc / f"{c}111").write_bytes(b"y" * 5)
    (inc / f"{c}.part").write_bytes(b"y" * 7)     # git-lfs's own .part wins: c's is left alone
    (inc / f"{other}222").write_bytes(b"z" * 9)   # not asked for: left alone
    held = open(inc / f"{d}333", "wb")            # a download still running (this process has it open)
    held.write(b"w" * 4)
    held.flush()
    try:
        assert adopt_partials(tmp_path, {a, b, c, d}) == 1
        names = sorted(p.name for p in inc.iterdir())
    finally:
        held.close()
    assert (inc / f"{a}.part").read_bytes() == b"x" * 30
    assert names == sorted([f"{a}.part", f"{c}111", f"{c}.part", f"{other}222", f"{d}333"])


def test_no_incomplete_folder_is_nothing_to_do(tmp_path):
    assert adopt_partials(tmp_path, {oid(1)}) == 0
