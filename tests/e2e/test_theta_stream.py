"""Smudge streamed straight to git (no temp file): same bytes as the file path, pkt-line framing, and a
group that fails its content hash after content was sent still makes git refuse the checkout."""
import dataclasses
import io
import os
import threading

import numpy as np
import pytest
import torch
from support.crafted import flip_byte
from support.gitrepo import GitEnv

from zipslice import dtypes

from theta.git.pktline import MAX_PAYLOAD, PktReader, PktWriter
from theta.model.clean import clean_checkpoint
from theta.model.smudge import smudge_checkpoint, smudge_to_stream, streams
from theta.storage.metadata import dumps, loads
from theta.storage.store import LfsStore


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 200, generator=g), "a.bias": torch.randn(300, generator=g),
            "b.weight": torch.randn(200, 300, generator=g).to(torch.bfloat16), "step": torch.tensor(3)}


@pytest.mark.parametrize("use_pipe", [False, True])
def test_content_writer_frames_any_write_sizes(use_pipe):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 600_000, dtype=np.uint8).tobytes()
    sizes = [3, 100, 70_000, 5, MAX_PAYLOAD, 1, 2 * MAX_PAYLOAD, 20_000, MAX_PAYLOAD - 1, 200_000]
    got = []
    if use_pipe:
        r, w = os.pipe()
        f = os.fdopen(w, "wb")
        reader = threading.Thread(target=lambda: got.append(os.fdopen(r, "rb").read()))
        reader.start()
    else:
        f = io.BytesIO()
    out = PktWriter(f).content()
    pos = 0
    for s in sizes:
        out.write(memoryview(data)[pos:pos + s])
        pos += s
    out.close()
    if use_pipe:
        f.close()
        reader.join()
        raw = got[0]
    else:
        raw = f.getvalue()
    packets = list(PktReader(io.BytesIO(raw)).iter_content())
    assert b"".join(packets) == data[:pos]
    assert all(len(p) == MAX_PAYLOAD for p in packets[:-1])  # full packets: few, large writes
    assert out.sent == pos


def test_streamed_smudge_equals_file_smudge(tmp_path):
    store = LfsStore(tmp_path / "objects")
    src = tmp_path / "model.pt"
    sd = _state()
    torch.save({"model": sd, "epoch": 2}, src)
    meta = loads(dumps(clean_checkpoint(src, store, None)))
    assert streams(meta) and not streams(meta, "safetensors")
    (tmp_path / "out").mkdir()
    smudge_checkpoint(meta, store, tmp_path / "out" / "model.pt")
    buf = io.BytesIO()
    smudge_to_stream(meta, store, buf, "model.pt")
    assert buf.getvalue() == (tmp_path / "out" / "model.pt").read_bytes()
    (tmp_path / "s.pt").write_bytes(buf.getvalue())
    got = torch.load(tmp_path / "s.pt", weights_only=True)
    assert got["epoch"] == 2
    for k, v in sd.items():
        assert torch.equal(got["model"][k], v), k


def test_bad_group_after_content_started_fails_the_checkout(tmp_path):
    genv = GitEnv.create(tmp_path)
    repo = genv.init("work")
    sd = _state(1)
    torch.save(sd, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    meta = loads(repo.show("HEAD:model.pt"))
    # the LAST group's recorded hash is wrong: everything before it has streamed to git when it is found
    last = meta.order[-1]
    group = meta.groups[meta.group_for(last).name]
    group.hash = "0" * 64  # the group and its last step agree (as the schema requires) and both are wrong
    group.steps[-1] = dataclasses.replace(group.steps[-1], hash="0" * 64)
    (repo / "model.pt").write_text(dumps(meta))  # metadata passes through clean unchanged
    repo.commit("bad", "model.pt")
    (repo / "model.pt").unlink()
    # "hash": every group is hashed (the default "frames" trusts a dense blob's own zstd checksums instead)
    proc = genv.run(["git", "checkout", "--", "model.pt"], cwd=repo.path, check=False,
                    extra_env={"GIT_THETA_VERIFY": "hash"})
    assert proc.returncode != 0
    assert b"content hash" in proc.stderr
    assert not (repo / "model.pt").exists()  # git dropped the streamed bytes
    genv.run(["git", "checkout", "HEAD~1", "--", "model.pt"], cwd=repo.path)
    got = torch.load(repo / "model.pt", weights_only=True)
    assert list(got) == list(sd) and all(torch.equal(got[k], v) for k, v in sd.items())


def test_frames_verification_catches_a_flipped_byte_at_checkout(tmp_path):
    genv = GitEnv.create(tmp_path)
    repo = genv.init("work")
    sd = _state(2)
    torch.save(sd, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    meta = loads(repo.show("HEAD:model.pt"))
    group = meta.groups[meta.group_for("a.weight").name]
    assert [s.type for s in group.steps] == ["dense"]
    obj = repo.lfs_object(group.steps[0].blob.oid)
    flip_byte(obj, obj.stat().st_size // 3)  # inside a plane: only the frame checksum can tell
    (repo / "model.pt").unlink()
    proc = genv.run(["git", "checkout", "--", "model.pt"], cwd=repo.path, check=False)
    assert proc.returncode != 0
    assert b"a.weight" in proc.stderr or b"corrupt" in proc.stderr
    assert not (repo / "model.pt").exists()


def test_frames_verification_skips_only_the_hash_of_single_dense_steps(tmp_path, monkeypatch):
    import theta.model.smudge as sm
    store = LfsStore(tmp_path / "objects")
    src = tmp_path / "model.pt"
    torch.save(_state(3), src)
    meta = loads(dumps(clean_checkpoint(src, store, None)))
    hashed, whole = [], []  # bytes hashed as frames pass; groups hashed whole
    real_hash, real_submit = sm._hash_frame, sm._HashChecker.submit
    monkeypatch.setattr(sm, "_hash_frame", lambda value, frame, first, high: hashed.append(frame.nbytes)
                        or real_hash(value, frame, first, high))
    monkeypatch.setattr(sm._HashChecker, "submit", lambda self, g, v: whole.append(g.name) or real_submit(self, g, v))
    framed, full = io.BytesIO(), io.BytesIO()
    smudge_to_stream(meta, store, framed, "model.pt", verify="frames")
    assert hashed == [] and whole == []  # every group here is one dense step with checksummed frames
    smudge_to_stream(meta, store, full, "model.pt", verify="hash")
    nbytes = sum(g.numel * dtypes.get(g.dtype).itemsize for g in meta.groups.values())
    assert sum(hashed) == nbytes and whole == [] and framed.getvalue() == full.getvalue()
    with pytest.raises(Exception, match="unknown verification"):
        smudge_to_stream(meta, store, io.BytesIO(), "model.pt", verify="none")
