"""Files theta tracks that are not checkpoints (``* filter=theta`` catches a README too) are stored as ONE
opaque blob, as git-lfs would, with a one-line warning, and checked out bit for bit."""
from __future__ import annotations

import hashlib
import io
import os
import zipfile

import numpy as np
import pytest
import torch

from theta.storage.metadata import OPAQUE_FORMAT, dumps, is_metadata, loads

from support.checkpoints import assert_same_checkpoint, make_state, save_pt
from support.crafted import leftovers
from support.gitrepo import GitEnv, bare_lfs_objects


def _zip_without_pickle() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("word/document.xml", "<xml/>")
    return buf.getvalue()


FILES = {
    "README.md": b"# a model\n\nSome text.\n",
    "empty/__init__.py": b"",
    "data/zeros.bin": b"\x00" * 100,
    "data/random.bin": np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8).tobytes(),
    "docs/report.docx": _zip_without_pickle(),
    "page.html": b"<!DOCTYPE html><html></html>",
    "notes.txt": "unicode \u00e9\u4e2d\r\nCRLF kept\r\n".encode(),
}


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def test_everything_tracked_round_trips_bit_for_bit(genv):
    repo = genv.init("work", track=("*",))
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    for name, data in FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    sd = make_state(2)
    save_pt(repo / "model.pt", sd)
    proc = repo.git("add", "-A")
    warnings = [ln for ln in proc.stderr.decode().splitlines() if "opaque" in ln]
    assert len(warnings) == len(FILES), proc.stderr.decode()  # one line per file, none for the checkpoint
    assert all(ln.startswith("git-theta: warning: ") and "is not a checkpoint" in ln for ln in warnings)
    repo.commit("everything")
    for name, data in FILES.items():
        meta = loads(repo.show(f"HEAD:{name}"), file=name)
        assert meta.format == OPAQUE_FORMAT and meta.version == 2
        assert meta.opaque.oid == hashlib.sha256(data).hexdigest() and meta.opaque.size == len(data)
    assert loads(repo.show("HEAD:model.pt")).format == "torch"
    assert repo.status() == ""
    repo.git("push", "-q", "origin", "main")
    # every non-empty opaque blob went to the remote (git-lfs never moves the empty one: theta needs none)
    assert {hashlib.sha256(d).hexdigest() for d in FILES.values() if d} <= bare_lfs_objects(bare.path)

    genv.run(["git", "theta", "install"], cwd=genv.home)
    clone = genv.clone(f"file://{bare.path}", "clone")
    for name, data in FILES.items():
        assert (clone / name).read_bytes() == data, name
    assert_same_checkpoint(clone / "model.pt", sd)
    assert clone.status() == ""
    assert leftovers(clone) == []

    # a change to an opaque file is a new blob; the diff driver says what changed without failing
    (clone / "README.md").write_bytes(b"# changed\n")
    assert clone.status() == "M README.md"
    diff = clone.git("diff", "README.md").stdout.decode()
    assert "not a checkpoint" in diff and "sha256" in diff
    clone.commit("readme", "README.md")
    assert loads(clone.show("HEAD:README.md")).opaque.oid == hashlib.sha256(b"# changed\n").hexdigest()
    os.unlink(clone / "README.md")
    clone.git("checkout", "--", "README.md")
    assert (clone / "README.md").read_bytes() == b"# changed\n"


def test_damaged_and_unsafe_checkpoints_are_still_refused(genv):
    """Opaque is for files that are no checkpoint at all; a damaged or unsafe one is an error, never stored
    (theta must not hand a malicious pickle to the next person who clones)."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    good = (repo / "model.pt").read_bytes()
    (repo / "model.pt").write_bytes(good[: len(good) // 2])
    proc = repo.git("add", "model.pt", check=False)
    assert proc.returncode != 0 and b"git-theta: error" in proc.stderr and b"opaque" not in proc.stderr

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"w": torch.zeros(2), "x": Evil()}, repo / "model.pt")
    proc = repo.git("add", "model.pt", check=False)
    assert proc.returncode != 0 and b"os.system" in proc.stderr or b"posix.system" in proc.stderr
    assert repo.out("ls-files") == ""


def test_opaque_metadata_is_version_2_and_version_1_is_still_read(tmp_path):
    from theta.model.clean import store_opaque
    from theta.storage.store import LfsStore

    store = LfsStore(tmp_path / "objects")
    (tmp_path / "f.bin").write_bytes(b"abc")
    meta = store_opaque(tmp_path / "f.bin", store)
    text = dumps(meta)
    assert text.startswith("theta-metadata 2\n") and is_metadata(text)
    assert loads(text) == meta
    assert store.get(meta.opaque) == b"abc"
    # an older theta names the version it lacks instead of misreading the file
    body = [line for line in text.splitlines() if not line.startswith("#")]  # the hint line is a comment
    assert '{"opaque":' in text and body[2].startswith('{"opaque"')


@pytest.mark.slow
def test_opaque_merge_follows_the_changed_side_and_conflicts_on_both(genv):
    repo = genv.init("work", track=("*.bin",))
    (repo / "a.bin").write_bytes(b"base")
    repo.commit("base", ".gitattributes", "a.bin")
    repo.git("checkout", "-q", "-b", "theirs")
    (repo / "a.bin").write_bytes(b"theirs")
    repo.commit("t", "a.bin")
    repo.git("checkout", "-q", "main")
    (repo / "other.bin").write_bytes(b"x")
    repo.commit("o", "other.bin")
    repo.git("merge", "-q", "--no-edit", "theirs")
    assert (repo / "a.bin").read_bytes() == b"theirs"
    repo.git("checkout", "-q", "-b", "both", "HEAD~1")
    (repo / "a.bin").write_bytes(b"ours")
    repo.commit("o2", "a.bin")
    proc = repo.git("merge", "--no-edit", "theirs", check=False)
    assert proc.returncode != 0
    assert b"not a checkpoint" in proc.stderr and b"Traceback" not in proc.stderr
