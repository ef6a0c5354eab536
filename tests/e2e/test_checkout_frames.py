"""A checkout writing frame after frame (theta.model.smudge._FrameStream): the groups of one dense step (or a
split keyframe chain) go from the codec threads to the file one frame at a time, with their CRC patched in
afterwards. Checked: the same bytes as the whole-group path and as "hash" mode, a valid zip, memory below one
group, a group without a binding streamed too and hashed as it passes, writer asking out of the expected order,
and a flipped byte in a bound blob caught at a materialized checkout with the placeholder left in place."""
from __future__ import annotations

import io
import tracemalloc
import zipfile
from collections import OrderedDict

import pytest
import torch

from support.crafted import flip_byte
from support.gitrepo import GitEnv
from theta.model.clean import clean_checkpoint
from theta.model.smudge import _FrameStream, smudge_to_stream
from theta.storage.metadata import dumps, loads
from theta.storage.store import LfsStore

GROUP_MIB = 12  # three 4 MiB frames


def _state(seed=0, mib: int = GROUP_MIB) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(mib << 18, generator=g)  # fp32: ``mib`` MiB
    return OrderedDict([("embed.weight", big.reshape(-1, 256)), ("a.weight", torch.randn(300, 200, generator=g)),
                        ("a.bias", torch.randn(300, generator=g)),
                        ("b.weight", torch.randn(200, 300, generator=g).to(torch.bfloat16)),
                        ("head.weight", big.reshape(-1, 256)),  # tied to embed.weight: stored once
                        ("step", torch.tensor(3))])


class _Pipe(io.RawIOBase):
    """A stream that cannot seek (git's pipe): the writer takes whole groups."""

    def __init__(self, f):
        self.f = f

    def writable(self):
        return True

    def write(self, b):
        return self.f.write(b)


def _cleaned(tmp_path, mib: int = GROUP_MIB):
    store = LfsStore(tmp_path / "objects")
    src = tmp_path / "model.pt"
    sd = _state(mib=mib)
    torch.save(sd, src)
    meta = loads(dumps(clean_checkpoint(src, store, None)))  # clean binds each dense blob to its value
    return store, meta, sd


@pytest.fixture
def cleaned(tmp_path):
    return _cleaned(tmp_path)


def _smudge(tmp_path, meta, store, name, seekable=True, verify="frames", peak: dict | None = None) -> bytes:
    """The file written (into tmp_path/name/model.pt); ``peak``: gets the traced peak while writing it."""
    out = tmp_path / name / "model.pt"
    out.parent.mkdir()
    if peak is not None:
        tracemalloc.start()
    try:
        with open(out, "wb") as f:
            smudge_to_stream(meta, store, f if seekable else _Pipe(f), "model.pt", verify=verify)
        if peak is not None:
            peak[name] = tracemalloc.get_traced_memory()[1]
    finally:
        if peak is not None:
            tracemalloc.stop()
    return out.read_bytes()


def test_frames_write_the_same_file_as_whole_groups(tmp_path, cleaned):
    store, meta, sd = cleaned
    framed = _smudge(tmp_path, meta, store, "framed")
    assert framed == _smudge(tmp_path, meta, store, "pipe", seekable=False)
    assert framed == _smudge(tmp_path, meta, store, "hashed", verify="hash")
    with zipfile.ZipFile(tmp_path / "framed" / "model.pt") as z:
        assert z.testzip() is None
    got = torch.load(tmp_path / "framed" / "model.pt", weights_only=True)
    assert list(got) == list(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8) if v.dim() else got[k],
                                                       v.view(torch.uint8) if v.dim() else v), k
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # still tied


def test_frames_never_hold_a_whole_group(tmp_path):
    store, meta, _ = _cleaned(tmp_path, mib=48)  # 12 frames: far more than the stream decodes ahead
    group = 48 << 20
    peaks: dict = {}
    for name, seekable in (("framed", True), ("pipe", False)):
        _smudge(tmp_path, meta, store, name, seekable=seekable, peak=peaks)
    assert peaks["pipe"] >= group  # the whole-group path holds the largest group (at least)
    assert peaks["framed"] < 0.75 * group, peaks  # frames in flight only (at most ~6 x 4 MiB + zstd buffers)


def test_a_group_the_store_has_not_bound_is_streamed_hashed_and_bound(tmp_path, cleaned, monkeypatch):
    """As for blobs fetched from elsewhere: the group still goes frame by frame, every byte of it hashed as it
    passes (none of the bound ones), and is bound for the next checkout."""
    import theta.model.smudge as sm

    store, meta, _ = cleaned
    expected = _smudge(tmp_path, meta, store, "before")
    g = meta.groups[meta.group_for("a.weight").name]
    binding = store._binding(g.steps[0].blob.oid, g.hash)
    binding.unlink()
    hashed, whole = [], []
    real_hash, real_submit = sm._hash_frame, sm._HashChecker.submit
    monkeypatch.setattr(sm, "_hash_frame", lambda value, frame, first, high: hashed.append(frame.nbytes)
                        or real_hash(value, frame, first, high))
    monkeypatch.setattr(sm._HashChecker, "submit",
                        lambda self, grp, v: whole.append(grp.name) or real_submit(self, grp, v))
    assert _smudge(tmp_path, meta, store, "after") == expected
    assert sum(hashed) == 300 * 200 * 4 and whole == []
    sm.parallel.pool("hash").submit(lambda: None).result()  # (bindings are written on the hash thread)
    assert binding.exists()


def test_frames_asked_out_of_order_start_again_from_that_group(cleaned):
    store, meta, _ = cleaned
    names = [meta.group_for(n).name for n in ("embed.weight", "a.weight", "a.bias")]
    expected = {n: b"".join(bytes(f) for f in _FrameStream(meta, store, "m", [n]).frames_of(n)) for n in names}
    stream = _FrameStream(meta, store, "m", names)
    try:
        first = stream.frames_of(names[0])
        next(first)  # one frame of the embedding taken, then the writer asks for another group
        assert b"".join(bytes(f) for f in stream.frames_of(names[2])) == expected[names[2]]
        assert b"".join(bytes(f) for f in stream.frames_of(names[1])) == expected[names[1]]
    finally:
        stream.close()
    assert all(len(expected[n]) == meta.groups[n].numel * (2 if meta.groups[n].dtype == "bfloat16" else 4)
               for n in names if meta.groups[n].dtype in ("float32", "bfloat16"))


def test_a_flipped_byte_in_a_bound_blob_is_caught_and_the_placeholder_stays(tmp_path):
    genv = GitEnv.create(tmp_path)
    repo = genv.init("work")
    sd = _state(1)
    torch.save(sd, repo / "model.pt")
    repo.commit("v1", ".gitattributes", "model.pt")
    meta = loads(repo.show("HEAD:model.pt"))
    group = meta.groups[meta.group_for("embed.weight").name]
    obj = repo.lfs_object(group.steps[0].blob.oid)
    flip_byte(obj, obj.stat().st_size // 2)  # inside a plane of the second frame: only its checksum can tell
    (repo / "model.pt").unlink()
    proc = genv.run(["git", "checkout", "--", "model.pt"], cwd=repo.path, check=False)  # 12+ MiB: a placeholder
    err = proc.stderr.decode()
    assert "embed.weight" in err and "git theta checkout model.pt" in err, err
    assert (repo / "model.pt").read_bytes() == repo.show("HEAD:model.pt")  # the placeholder, not a part
    assert repo.status() == ""
    assert not list((repo.git_common_dir() / "theta").glob("materialize-*"))
