"""theta.storage.codec: lossless, bit-for-bit round trips of every dtype, framing, and corrupt-blob errors."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipslice import dtypes

from theta.base.errors import CodecError
from theta.storage import codec

ALL_DTYPES = [d.name for d in dtypes._TABLE]


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def random_array(name: str, shape, seed=0) -> np.ndarray:
    dt = dtypes.get(name)
    n = int(np.prod(shape))
    raw = np.random.default_rng(seed).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    if name == "bool":
        raw = raw % 2
    return raw.view(dt.to_numpy()).reshape(shape)


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 17)])
def test_round_trip_every_dtype_bit_for_bit(name, shape):
    a = random_array(name, shape)
    out = codec.decode_array(codec.encode_array(a))
    assert out.dtype == dtypes.get(name).to_numpy()
    assert out.shape == shape
    assert bits(out) == bits(a)  # bit for bit, NaN payloads included


def test_special_float_values_survive():
    a = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38], dtype=np.float32)
    out = codec.decode_array(codec.encode_array(a))
    assert bits(out) == bits(a)


def test_frames_split_and_join(monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 1000)  # many frames, uneven last one
    a = (np.random.default_rng(1).standard_normal(12345) * 0.02).astype(ml_dtypes.bfloat16)
    blob = codec.encode_array(a)
    assert bits(codec.decode_array(blob)) == bits(a)
    b = np.random.default_rng(2).integers(-5, 5, 4321, dtype=np.int64)
    assert bits(codec.decode_array(codec.encode_array(b))) == bits(b)


def test_big_endian_input_is_stored_little_endian():
    a = np.arange(10, dtype=">f4")
    out = codec.decode_array(codec.encode_array(a))
    assert out.dtype == np.dtype("<f4") and np.array_equal(out, a)


def test_deterministic_and_compresses_weights():
    a = (np.random.default_rng(3).standard_normal(1 << 18) * 0.02).astype(np.float32)
    b1, b2 = codec.encode_array(a), codec.encode_array(a.copy())
    assert b1 == b2
    assert len(b1) < 0.9 * a.nbytes
    h = a.astype(ml_dtypes.bfloat16)
    assert len(codec.encode_array(h)) < 0.75 * h.nbytes


def test_non_contiguous_input():
    a = np.arange(60, dtype=np.float32).reshape(6, 10)[:, ::3]
    assert np.array_equal(codec.decode_array(codec.encode_array(a)), a)


def test_parts_round_trip_sorted_and_deterministic():
    parts = {"values": np.arange(6, dtype=np.float32).reshape(2, 3), "idx": np.array([4, 1], dtype=np.int64),
             "mask": np.array([True, False])}
    blob = codec.encode_parts(parts)
    assert blob == codec.encode_parts(dict(reversed(list(parts.items()))))
    out = codec.decode_parts(blob)
    assert sorted(out) == ["idx", "mask", "values"]
    for k in parts:
        assert out[k].dtype == parts[k].dtype and bits(out[k]) == bits(parts[k])


def test_corrupt_blobs_raise_codec_error():
    blob = codec.encode_array(np.arange(1000, dtype=np.float32))
    with pytest.raises(CodecError, match="magic"):
        codec.decode_array(b"XXXX" + blob[4:])
    with pytest.raises(CodecError, match="truncated|frames say"):
        codec.decode_array(blob[:-10])
    with pytest.raises(CodecError):
        codec.decode_array(blob[:6])
    bad = bytearray(blob)
    bad[-20] ^= 0xFF
    with pytest.raises(CodecError):
        codec.decode_array(bytes(bad))
    with pytest.raises(CodecError):
        codec.decode_parts(blob)  # an array blob is not a parts blob


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ALL_DTYPES), data=st.binary(max_size=400))
def test_property_any_bits_round_trip(name, data):
    dt = dtypes.get(name)
    n = len(data) // dt.itemsize
    raw = np.frombuffer(data[: n * dt.itemsize], dtype=np.uint8).copy()
    if name == "bool":
        raw %= 2
    a = raw.view(dt.to_numpy())
    assert bits(codec.decode_array(codec.encode_array(a))) == bits(a)


@pytest.mark.parametrize("item", [1, 2, 3, 4, 8, 16])
def test_byte_planes_through_words_equal_the_transposed_bytes(item):
    """codec._to_planes (shift-and-narrow of whole words where the width allows) is bit for bit the strided
    transpose the blob format defines: plane i = byte i of every element."""
    from theta.storage.codec import _to_planes

    frame = np.random.default_rng(item).integers(0, 256, 1000 * item, dtype=np.uint8)
    want = frame.reshape(-1, item).T
    got = _to_planes(frame, item)
    assert len(got) == item
    for i in range(item):
        assert got[i].dtype == np.uint8 and got[i].tobytes() == want[i].tobytes()



def _fine_tune(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prev = (rng.standard_normal(n) * 0.05).astype(np.float32)
    return (prev * (1 + 1e-3 * rng.standard_normal(n))).astype(np.float32), prev


def test_a_plane_near_noise_is_told_apart_from_one_huffman_shrinks():
    rng = np.random.default_rng(3)
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    weights = (rng.standard_normal(1 << 20) * 0.05).astype(np.float32).view(np.uint8).reshape(-1, 4)
    assert codec._near_noise(noise)
    assert codec._near_noise(np.ascontiguousarray(weights[:, 0]))       # low mantissa byte
    assert not codec._near_noise(np.ascontiguousarray(weights[:, 3]))   # sign and exponent
    assert not codec._near_noise(np.zeros(1 << 20, np.uint8))
    assert not codec._near_noise(noise[:codec._NOISE_SAMPLE])  # too small to judge: zstd decides


def test_near_noise_planes_keep_their_literals_and_the_rest_is_compressed_as_before():
    """A fine-tune's delta: its two low planes are near noise (stored as they are, at most a frame header and
    block headers over their size), its high planes still shrink to a few percent; the blob decodes bit for bit
    and the value's planes of sign and exponent are still Huffman coded in the dense blob."""
    from theta.updates.delta import lazy_codes

    new, prev = _fine_tune(codec.FRAME_BYTES // 4 * 2)
    blob = b"".join(codec.iter_encode_array(lazy_codes(new, prev, "zigzag")))
    layout = codec._array_layout(memoryview(blob))
    for count, sizes in layout.frames:
        assert count <= sizes[0] <= count * 1.001 and count <= sizes[1] <= count * 1.001  # kept as they are
        assert sizes[2] < count * 0.1 and sizes[3] < count * 0.01
    codes = codec.decode_array(blob)
    assert codes.tobytes() == lazy_codes(new, prev, "zigzag").read(0, new.size).tobytes()

    dense = codec._array_layout(memoryview(codec.encode_array(new)))
    for count, sizes in dense.frames:
        assert sizes[3] < count * 0.5  # the exponent plane: Huffman coding still pays
    assert bits(codec.decode_array(codec.encode_array(new))) == bits(new)


# ------------------------------------------------------------------ frames of zeros (a delta's unchanged frames)
def _frames_of(dtype, kinds: list[str]) -> np.ndarray:
    """One codec frame per kind: "noise", "zeros", or "sevens" (constant but not zero: compresses as well)."""
    per = codec.FRAME_BYTES // np.dtype(dtype).itemsize
    rng = np.random.default_rng(5)
    parts = []
    for k in kinds:
        if k == "noise" and np.dtype(dtype).kind == "u":
            parts.append(rng.integers(0, 1 << 16, per).astype(dtype))
        elif k == "noise":
            parts.append((rng.standard_normal(per) * 0.02).astype(dtype))
        else:
            parts.append(np.full(per, 0 if k == "zeros" else 7, dtype))
    return np.concatenate(parts)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, ml_dtypes.bfloat16], ids=["u16", "f32", "bf16"])
def test_frames_of_zeros_decode_bit_for_bit_and_are_told_apart(dtype):
    kinds = ["noise", "zeros", "sevens", "zeros", "noise"]
    a = _frames_of(dtype, kinds)
    blob = codec.encode_array(a)
    assert codec.decode_array(blob).view(np.uint8).tobytes() == a.view(np.uint8).tobytes()
    plain = list(codec.iter_decode_array(blob))
    assert not any(codec.is_zero_run(f) for _, f in plain)
    runs = list(codec.iter_decode_array(blob, zeros=True))
    assert [codec.is_zero_run(f) for _, f in runs] == [k == "zeros" for k in kinds]
    got = np.concatenate([np.asarray(f) for _, f in runs])
    assert got.view(np.uint8).tobytes() == a.view(np.uint8).tobytes()
    reader_frames = [f for _, f in runs if not codec.is_zero_run(f)]
    assert all(f.flags.writeable for f in reader_frames)  # decoded frames stay the caller's to modify


def test_a_corrupt_frame_of_zeros_is_refused_not_taken_for_zeros():
    a = _frames_of(np.uint16, ["zeros", "zeros"])
    blob = bytearray(codec.encode_array(a))
    layout = codec._array_layout(memoryview(blob))
    _, _, off, sizes = codec._frame_jobs(layout)[1]
    blob[off + sizes[0] // 2] ^= 0x5A  # inside the second frame's zstd bytes
    with pytest.raises(CodecError):
        codec.decode_array(bytes(blob))
    with pytest.raises(CodecError):
        list(codec.iter_decode_array(bytes(blob), zeros=True))
