"""Smudge streamed straight to git (no temp file): same bytes as the file path, pkt-line framing, and a
group that fails its content hash after content was sent still makes git refuse the checkout."""
import io
import os
import threading

import numpy as np
import pytest
import torch

from gitrepo import GitEnv
from theta.clean import clean_checkpoint
from theta.metadata import dumps, loads
from theta.pktline import MAX_PAYLOAD, PktReader, PktWriter
from theta.smudge import smudge_checkpoint, smudge_to_stream, streams
from theta.store import LfsStore


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
    meta.groups[meta.group_for(last).name].hash = "0" * 64
    (repo / "model.pt").write_text(dumps(meta))  # metadata passes through clean unchanged
    repo.commit("bad", "model.pt")
    (repo / "model.pt").unlink()
    proc = genv.run(["git", "checkout", "--", "model.pt"], cwd=repo.path, check=False)
    assert proc.returncode != 0
    assert b"content hash" in proc.stderr
    assert not (repo / "model.pt").exists()  # git dropped the streamed bytes
    genv.run(["git", "checkout", "HEAD~1", "--", "model.pt"], cwd=repo.path)
    got = torch.load(repo / "model.pt", weights_only=True)
    assert list(got) == list(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
