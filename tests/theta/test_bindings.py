"""Bindings (LfsStore.bind): "this blob decodes to that value, and every zstd frame of it carries a checksum".

A binding is made only for a blob whose frames all carry checksums (theta's encoder always writes them; any
other blob is checked when it is bound), so a rebuild trusting a bound blob reads no frame header ahead of
decoding: each frame's checksum is required, and verified, as that frame is decoded. Real blobs in a real
store; the only stand-ins are spies on theta's own helpers, to see which blobs were opened or checked."""
import numpy as np
import pytest
import zstandard

from theta.base.errors import CodecError
from theta.storage import codec
from theta.storage.metadata import GroupMeta, Step
from theta.storage.store import LfsStore
from theta.updates import content_hash, rebuild
from theta.updates.rebuild import bind_steps, chain_frames, chain_proven, decode_proven_dense


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "lfs" / "objects")


def value(seed=0):
    return np.random.default_rng(seed).standard_normal((64, 1024)).astype(np.float32)


def unchecksummed_blob(monkeypatch, arr) -> bytes:
    """``arr`` encoded as theta encodes it, but by compressors that write no frame checksum: a blob another
    encoder (or a forger) could have put on a server, decoding to the right value."""
    with monkeypatch.context() as m:
        m.setattr(codec, "_compressor",
                  lambda level, planes, noise=False: zstandard.ZstdCompressor(level=1, write_checksum=False))
        return codec.encode_parts({"values": arr})


def dense_group(store, blob: bytes, arr) -> GroupMeta:
    ref = store.put(blob)
    name = content_hash(arr)
    return GroupMeta(name="w", dtype="float32", shape=arr.shape, hash=name,
                     steps=[Step(type="dense", blob=ref, params={}, hash=name)])


def checks_spy(monkeypatch) -> list:
    """The blobs whose every frame header is read to see whether it carries a checksum."""
    checked = []
    real = codec.frames_checksummed
    monkeypatch.setattr(codec, "frames_checksummed", lambda blob: checked.append(len(blob)) or real(blob))
    return checked


def test_a_blob_theta_encoded_is_bound_without_reading_it(store, monkeypatch):
    arr = value()
    group = dense_group(store, codec.encode_parts({"values": arr}), arr)
    checked = checks_spy(monkeypatch)
    bind_steps(group.steps, store, encoded={group.steps[0].blob.oid})
    assert store.bound(group.steps[0].blob.oid, group.hash) and checked == []


def test_a_fetched_blob_is_bound_once_its_frames_are_checked(store, monkeypatch):
    arr = value()
    blob = codec.encode_parts({"values": arr})
    group = dense_group(store, blob, arr)
    checked = checks_spy(monkeypatch)
    bind_steps(group.steps, store)
    assert store.bound(group.steps[0].blob.oid, group.hash) and checked == [len(blob)]
    bind_steps(group.steps, store)  # bound already: not checked again
    assert checked == [len(blob)]


def test_a_fetched_blob_without_frame_checksums_is_never_bound(store, monkeypatch):
    arr = value()
    group = dense_group(store, unchecksummed_blob(monkeypatch, arr), arr)
    bind_steps(group.steps, store)
    assert not store.bound(group.steps[0].blob.oid, group.hash)
    assert not chain_proven(group, store)
    assert decode_proven_dense(group, store) is None  # not trusted: the caller rebuilds and hashes the value
    np.testing.assert_array_equal(rebuild.reconstruct(group, store), arr)


def test_trusting_a_bound_chain_opens_no_blob(store, monkeypatch):
    arr = value()
    group = dense_group(store, codec.encode_parts({"values": arr}), arr)
    bind_steps(group.steps, store, encoded={group.steps[0].blob.oid})
    opened = []
    real = LfsStore.mapped
    monkeypatch.setattr(LfsStore, "mapped", lambda self, ref, **kw: opened.append(ref.oid) or real(self, ref, **kw))
    checked = checks_spy(monkeypatch)
    assert chain_proven(group, store) and opened == []
    with chain_frames(group, store) as frames:
        assert frames.proven and frames.plan.checksums
        out = np.concatenate([frames.decode(job, None) for job in frames.plan.jobs])
    assert out.tobytes() == arr.tobytes() and checked == []
    np.testing.assert_array_equal(decode_proven_dense(group, store), arr)


def test_a_bound_blob_with_a_frame_without_checksum_fails_naming_group_and_blob(store, monkeypatch):
    """A store whose binding vouches for a blob without checksums (written by hand, or by an older theta):
    decoding it trusted fails, located, rather than handing out bytes nothing checked."""
    arr = value()
    group = dense_group(store, unchecksummed_blob(monkeypatch, arr), arr)
    oid = group.steps[0].blob.oid
    store.bind(oid, group.hash)
    with pytest.raises(CodecError, match=rf"m\.safetensors.*'w'.*{oid[:12]}.*carries no checksum"):
        decode_proven_dense(group, store, "m.safetensors")
    with chain_frames(group, store, "m.safetensors") as frames, pytest.raises(CodecError, match="no checksum"):
        frames.decode(frames.plan.jobs[0], None)
