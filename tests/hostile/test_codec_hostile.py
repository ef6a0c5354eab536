"""Forged theta blobs: every header claim is checked against the blob's own bytes before anything is
allocated (zstd cannot expand more than 32768x), and every error met while rebuilding names the file, the
group and the blob."""
from __future__ import annotations

import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
import zstandard

from theta.base.errors import BlobCorruptError, ChainError, CodecError, IntegrityError
from theta.storage import codec
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore
from theta.updates.rebuild import reconstruct

from support.crafted import group_line, step, value_hash


def _array_blob(header: dict, payload: bytes = b"") -> bytes:
    h = msgpack.packb(header)
    return codec.ARRAY_MAGIC + payload + h + struct.pack("<I", len(h)) + codec.ARRAY_MAGIC


def _parts_blob(parts: list[tuple[str, bytes]]) -> bytes:
    body = b"".join(b for _, b in parts)
    h = msgpack.packb({"parts": [[n, len(b)] for n, b in parts]})
    return codec.PARTS_MAGIC + body + h + struct.pack("<I", len(h)) + codec.PARTS_MAGIC


ZEROS_FRAME = zstandard.ZstdCompressor(level=1).compress(b"\0" * 1024)


@pytest.mark.parametrize("header,payload,fragment", [
    ({"dtype": "float32", "shape": [1 << 40], "enc": "planes", "frames": [[1 << 40, [1, 1, 1, 1]]]}, b"xxxx",
     "more than zstd can produce"),
    ({"dtype": "uint8", "shape": [1 << 30], "enc": "zstd", "frames": [[1 << 30, [len(ZEROS_FRAME)]]]},
     ZEROS_FRAME, "more than zstd can produce"),
    ({"dtype": "uint8", "shape": [4096], "enc": "zstd", "frames": [[4096, [len(ZEROS_FRAME)]]]}, ZEROS_FRAME,
     "declares 1024 bytes, its header 4096"),
    ({"dtype": "float32", "shape": [-4], "enc": "planes", "frames": []}, b"", "not a non-negative integer"),
    ({"dtype": "float32", "shape": [1] * 65, "enc": "planes", "frames": []}, b"", "at most 64 dimensions"),
    ({"dtype": "float99", "shape": [1], "enc": "planes", "frames": []}, b"", "unknown dtype"),
    ({"dtype": "uint8", "shape": [1], "enc": "planes", "frames": []}, b"", "does not fit dtype uint8"),
    ({"dtype": "uint8", "shape": [2], "enc": "zstd", "frames": [[1, [0]], [1, [0]]], "x": 1}, b"", "fields"),
    ({"dtype": "uint8", "shape": [2], "enc": "zstd", "frames": [[2, [1, 1]]]}, b"xx", "compressed parts"),
    ({"dtype": "uint8", "shape": [3], "enc": "zstd", "frames": [[2, [0]]]}, b"", "frames hold 2 elements"),
    ({"dtype": "uint8", "shape": [0], "enc": "zstd", "frames": "x" * 10}, b"", "frames is not a list"),
])
def test_forged_array_headers_are_refused_before_allocating(header, payload, fragment):
    blob = _array_blob(header, payload)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match=fragment):
            codec.decode_array(blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"allocated {peak} bytes before refusing"


def test_msgpack_bombs_in_headers_are_refused():
    # an array header claiming 2**32 items in 5 bytes, a map of 2**32 entries
    for bomb in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        blob = codec.ARRAY_MAGIC + bomb + struct.pack("<I", len(bomb)) + codec.ARRAY_MAGIC
        with pytest.raises(CodecError, match="header"):
            codec.decode_array(blob)
    with pytest.raises(CodecError, match="header needs 67108865 bytes, blob has 20"):  # a length beyond the blob
        codec.decode_array(codec.ARRAY_MAGIC + b"\0" * 8 + struct.pack("<I", (64 << 20) + 1) + codec.ARRAY_MAGIC)


def test_parts_blobs_tile_their_payload_exactly():
    good = codec.encode_array(np.arange(4, dtype=np.int64))
    with pytest.raises(CodecError, match="twice"):
        codec.decode_parts(_parts_blob([("a", good), ("a", good)]))
    too_many = _parts_blob([(f"p{i}", good) for i in range(codec.MAX_PARTS + 1)])
    with pytest.raises(CodecError, match="at most 64 parts"):
        codec.decode_parts(too_many)
    assert list(codec.decode_parts(_parts_blob([("a", good)]))) == ["a"]


def test_a_parts_budget_is_checked_before_decoding():
    blob = codec.encode_parts({"values": np.zeros(1 << 20, np.float32)})  # 4 MiB of zeros, a few KB of blob
    assert codec.parts_nbytes(blob) == 4 << 20
    with pytest.raises(CodecError, match="more than the 1000 this step"):
        codec.decode_parts(blob, max_bytes=1000)


def _store_with(tmp_path, blob: bytes):
    store = LfsStore(tmp_path / "objects")
    return store, store.put(blob)


def test_rebuild_errors_name_file_group_step_and_oid(tmp_path):
    arr = np.arange(64, dtype=np.float32)
    good = codec.encode_parts({"values": arr})
    flipped = bytearray(good)
    flipped[len(good) // 3] ^= 0x10
    store, ref = _store_with(tmp_path, bytes(flipped))
    g = GroupMeta.from_json(group_line("enc.w", "float32", [64], [step("dense", ref, value_hash(arr))]))
    with pytest.raises(IntegrityError) as e:
        reconstruct(g, store, file="model.pt")
    msg = str(e.value)
    assert msg.startswith("model.pt: group 'enc.w': step 0") and ref.oid in msg
    assert e.value.file == "model.pt" and e.value.group == "enc.w" and e.value.oid == ref.oid


def test_a_value_of_another_shape_or_hash_is_named(tmp_path):
    arr = np.arange(64, dtype=np.float32)
    store, ref = _store_with(tmp_path, codec.encode_parts({"values": arr}))
    g = GroupMeta.from_json(group_line("w", "float32", [8, 9], [step("dense", ref, value_hash(arr))]))
    with pytest.raises(ChainError, match="model.pt: group 'w': step 0 .*rebuilt 64 values, expected shape"):
        reconstruct(g, store, file="model.pt")
    g = GroupMeta.from_json(group_line("w", "float32", [64], [step("dense", ref, "0" * 64)]))
    with pytest.raises(ChainError, match=f"model.pt: group 'w': step 0 \\(blob {ref.oid}\\).*hash differs"):
        reconstruct(g, store, file="model.pt")


def test_a_truncated_object_is_named(tmp_path):
    arr = np.arange(64, dtype=np.float32)
    store, ref = _store_with(tmp_path, codec.encode_parts({"values": arr}))
    p = store.path(ref)
    p.write_bytes(p.read_bytes()[:-3])
    g = GroupMeta.from_json(group_line("w", "float32", [64], [step("dense", ref, value_hash(arr))]))
    with pytest.raises(BlobCorruptError) as e:
        reconstruct(g, store, file="model.pt")
    assert str(e.value).startswith("model.pt: group 'w'") and ref.oid in str(e.value)


def test_an_update_type_meeting_forged_parts_never_raises_a_traceback(tmp_path):
    """sparse indices past the end, delta planes of the wrong shape, low-rank factors that do not fit:
    ChainError naming the group and step, never IndexError or ValueError."""
    base = np.arange(16, dtype=np.float32)
    store = LfsStore(tmp_path / "objects")
    dense = store.put(codec.encode_parts({"values": base}))
    forged = [
        ("sparse", {"gaps": np.array([100], np.uint32), "values": np.ones(1, np.float32)}, {"count": 1}),
        ("sparse", {"gaps": np.array([1], np.uint32)}, {"count": 1}),
        ("delta", {"planes": np.zeros((4, 3), np.uint8)}, {"op": "zigzag"}),
        ("delta", {"planes": np.zeros((4, 16), np.uint8)}, {"op": "rot13"}),
        ("low-rank", {"R": np.ones((2, 1), np.float32), "C": np.ones((1, 3), np.float32)}, {"rank": 1}),
        ("rows", {"source_gaps": np.array([99], np.int32), "extra": np.zeros((0,), np.float32)}, {"rows": 1}),
        ("ia3", {"ia3": np.ones((3, 3), np.float32)}, {}),
    ]
    for kind, parts, params in forged:
        ref = store.put(codec.encode_parts(parts))
        g = GroupMeta.from_json(group_line("w", "float32", [16], [step("dense", dense, value_hash(base)),
                                                                  step(kind, ref, "1" * 64, params)]))
        with pytest.raises(ChainError) as e:
            reconstruct(g, store, file="model.pt")
        assert str(e.value).startswith("model.pt: group 'w': step 1") and ref.oid in str(e.value), kind
