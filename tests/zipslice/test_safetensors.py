"""safetensors: files written by the safetensors library read through zipslice bit for bit, our writer's
output read back by the library, and hostile headers refused with precise errors."""
from __future__ import annotations

import importlib.util
import json
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import given, settings, strategies as st

import zipslice
from zipslice import dtypes
from zipslice.errors import CorruptCheckpointError, UnsupportedCheckpointError, ZipsliceError
from zipslice.info import TensorSource
from zipslice.safetensors_format import SafetensorsCheckpoint, write

from support import FIXTURES

ST_DTYPES = [d for d in dtypes.BY_NAME.values() if d.safetensors]


def _random_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of any dtype (bool gets 0/1), built from bytes so NaN payloads are exercised too."""
    g = np.random.default_rng(seed)
    dt = dtypes.get(dtype_name)
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtypes.to_torch(dt.name))
    if dt.name == "bool":
        raw = g.integers(0, 2, n, dtype=np.uint8)
    else:
        raw = g.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtypes.to_torch(dt.name)).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _library_file(tmp_path, name="lib.safetensors", metadata=None) -> tuple[str, dict]:
    tensors = {}
    for i, d in enumerate(ST_DTYPES):
        tensors[f"t.{d.name}"] = _random_tensor(d.name, (3, 5), i)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["big.weight"] = _random_tensor("float32", (64, 33), 99)
    path = str(tmp_path / name)
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    return path, tensors


def test_every_dtype_matches_the_library_bit_for_bit(tmp_path):
    path, tensors = _library_file(tmp_path, metadata={"format": "pt", "note": "héllo"})
    assert zipslice.sniff(path) == "safetensors"
    with zipslice.load(path) as lsd, safetensors.safe_open(path, framework="pt") as ref:
        assert isinstance(lsd, SafetensorsCheckpoint) and lsd.format == "safetensors"
        assert sorted(lsd) == sorted(ref.keys()) == sorted(tensors)
        assert lsd.metadata == {"format": "pt", "note": "héllo"}
        for key in ref.keys():
            want = ref.get_tensor(key)
            got = lsd[key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert _bits(got) == _bits(want), key
            assert bytes(lsd.read_bytes(key)) == _bits(want), key


def test_numpy_view_matches_safetensors_numpy(tmp_path):
    arrays = {
        "f16": np.arange(12, dtype="<f2").reshape(3, 4), "i64": np.arange(-5, 5, dtype="<i8"),
        "u8": np.arange(7, dtype="u1"), "c64": (np.arange(4) + 1j).astype("<c8"), "b": np.array([True, False]),
        "f64": np.array([np.nan, -0.0, np.inf], dtype="<f8"), "u32": np.arange(3, dtype="<u4"),
    }
    path = str(tmp_path / "np.safetensors")
    safetensors.numpy.save_file(arrays, path)
    ref = safetensors.numpy.load_file(path)
    with zipslice.load(path) as lsd:
        for key, want in ref.items():
            got = lsd.numpy(key)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key


def test_info_points_at_the_bytes_without_reading_them(tmp_path):
    path, tensors = _library_file(tmp_path)
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    with zipslice.load(path) as lsd:
        assert lsd.header_nbytes == n
        offsets = []
        for key in lsd:
            info = lsd.info(key)
            begin, end = header[key]["data_offsets"]
            assert info.offset == 8 + n + begin and info.span_nbytes == end - begin
            assert info.storage == key and info.is_contiguous and info.file == path
            assert blob[info.offset:info.offset + info.span_nbytes] == _bits(tensors[key])
            offsets.append(info.offset)
        assert offsets == sorted(offsets), "tensors are listed in file order"


def test_bfloat16_and_float8_raw_numpy(tmp_path):
    t = {"bf": _random_tensor("bfloat16", (4,), 1), "f8": _random_tensor("float8_e5m2", (4,), 2)}
    path = str(tmp_path / "x.safetensors")
    safetensors.torch.save_file(t, path)
    with zipslice.load(path) as lsd:
        assert lsd.numpy("bf", raw=True).dtype == np.dtype("<u2")
        assert lsd.numpy("bf", raw=True).tobytes() == _bits(t["bf"])
        import ml_dtypes
        assert lsd.numpy("f8").dtype == np.dtype(ml_dtypes.float8_e5m2)


# -- writer --------------------------------------------------------------------------------------------

def test_writer_output_is_byte_identical_to_the_library(tmp_path):
    _, tensors = _library_file(tmp_path)
    for metadata in (None, {"format": "pt"}):
        ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        zipslice.save(ours, tensors, metadata=metadata)
        safetensors.torch.save_file(tensors, str(theirs), metadata=metadata)
        assert ours.read_bytes() == theirs.read_bytes()


def test_writer_output_loads_in_every_library_loader(tmp_path):
    _, tensors = _library_file(tmp_path)
    out = str(tmp_path / "ours.safetensors")
    zipslice.save(out, tensors, metadata={"b": "2", "a": "1", "format": "pt"})
    loaded = safetensors.torch.load_file(out)
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and _bits(loaded[k]) == _bits(v), k
    with safetensors.safe_open(out, framework="pt") as f:
        assert f.metadata() == {"a": "1", "b": "2", "format": "pt"}
    # safetensors.numpy has no numpy dtype for bfloat16 / float8: check it on the dtypes numpy knows
    plain = {k: v for k, v in tensors.items() if "float8" not in k and "bfloat16" not in k}
    zipslice.save(out, plain)
    as_np = safetensors.numpy.load_file(out)
    assert sorted(as_np) == sorted(plain)
    for k, v in plain.items():
        assert as_np[k].shape == tuple(v.shape) and as_np[k].tobytes() == _bits(v), k
    with open(out, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n % 8 == 0, "the header is padded so the data is 8-aligned"


def test_streaming_conversion_round_trip_is_identical(tmp_path):
    path, _ = _library_file(tmp_path, metadata={"format": "pt"})
    copy = tmp_path / "copy.safetensors"
    with zipslice.load(path) as lsd:
        zipslice.save(copy, lsd)
    assert copy.read_bytes() == open(path, "rb").read()


def test_tied_sources_are_written_once_per_name(tmp_path):
    shared = torch.arange(6, dtype=torch.float32)
    out = str(tmp_path / "tied.safetensors")
    # the library refuses shared tensors in save_file; zipslice writes each name as its own tensor
    with pytest.raises(RuntimeError):
        safetensors.torch.save_file({"a": shared, "b": shared}, str(tmp_path / "lib.safetensors"))
    zipslice.save(out, {"a": shared, "b": shared})
    loaded = safetensors.torch.load_file(out)
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["b"], shared)
    with zipslice.load(out) as lsd:
        assert lsd.info("a").storage != lsd.info("b").storage


def test_writer_refuses_what_safetensors_cannot_hold(tmp_path):
    out = tmp_path / "x.safetensors"
    with pytest.raises(UnsupportedCheckpointError, match="complex128"):
        zipslice.save(out, {"c": np.zeros(2, dtype=np.complex128)})
    with pytest.raises(TypeError, match="str -> str"):
        zipslice.save(out, {"a": np.zeros(2)}, metadata={"epoch": 3})
    with pytest.raises(TypeError, match="unknown safetensors write options"):
        zipslice.save(out, {"a": np.zeros(2)}, compression="zstd")
    assert not out.exists()


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    out = tmp_path / "x.safetensors"
    zipslice.save(out, {"a": np.arange(3, dtype="<f4")})
    before = out.read_bytes()

    def boom():
        raise OSError("disk on fire")

    srcs = [TensorSource("a", "float32", (3,), lambda: np.zeros(3, "<f4").tobytes()),
            TensorSource("b", "float32", (3,), boom)]
    with pytest.raises(OSError, match="disk on fire"):
        write(out, srcs)
    short = [TensorSource("a", "float32", (3,), lambda: b"\0" * 4)]
    with pytest.raises(ZipsliceError, match="produced 4 bytes, expected 12"):
        write(out, short)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([d.name for d in ST_DTYPES]),
                          st.lists(st.integers(0, 4), max_size=3)), min_size=0, max_size=6),
       st.dictionaries(st.text(max_size=5), st.text(max_size=8), max_size=3))
def test_property_writer_matches_library_loader(tmp_path_factory, specs, metadata):
    tensors = {f"n{i}/{d}": _random_tensor(d, tuple(shape), i) for i, (d, shape) in enumerate(specs)}
    out = str(tmp_path_factory.mktemp("prop") / "p.safetensors")
    zipslice.save(out, tensors, metadata=metadata or None)
    loaded = safetensors.torch.load_file(out)
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        assert loaded[k].shape == v.shape and _bits(loaded[k]) == _bits(v)
    with zipslice.load(out) as lsd:
        assert lsd.metadata == (metadata or {})
        for k, v in tensors.items():
            assert _bits(lsd[k]) == _bits(v)


# -- hostile headers -----------------------------------------------------------------------------------

def _fixture_cases():
    spec = importlib.util.spec_from_file_location("make_st", FIXTURES / "make_safetensors_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


CASES = _fixture_cases()


def test_fixtures_are_reproducible():
    on_disk = {p.stem for p in (FIXTURES / "safetensors").glob("*.safetensors")}
    assert on_disk == set(CASES)
    for name, (blob, _, _) in CASES.items():
        assert (FIXTURES / "safetensors" / f"{name}.safetensors").read_bytes() == blob, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_header_is_refused(name):
    _, cls_name, fragment = CASES[name]
    path = FIXTURES / "safetensors" / f"{name}.safetensors"
    cls = {"CorruptCheckpointError": CorruptCheckpointError, "UnsupportedCheckpointError": UnsupportedCheckpointError}
    with pytest.raises(cls[cls_name]) as exc:
        zipslice.load(path)
    assert type(exc.value) is cls[cls_name]
    assert fragment in str(exc.value) and str(path) in str(exc.value)
    if name != "subbyte_dtype":  # the reference implementation agrees the file is broken
        with pytest.raises(Exception):
            safetensors.safe_open(str(path), framework="np")


def test_errors_name_the_tensor():
    with pytest.raises(CorruptCheckpointError) as exc:
        zipslice.load(FIXTURES / "safetensors" / "overlapping_offsets.safetensors")
    assert exc.value.entry == "b"


def test_header_that_is_not_an_object(tmp_path):
    p = tmp_path / "arr.safetensors"
    raw = b"[1, 2]  "
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptCheckpointError, match="JSON list, not an object"):
        SafetensorsCheckpoint(p)


def test_too_short_file(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x05\0\0")
    with pytest.raises(CorruptCheckpointError, match="too short"):
        SafetensorsCheckpoint(p)


def test_empty_checkpoint_round_trip(tmp_path):
    out = tmp_path / "empty.safetensors"
    zipslice.save(out, {})
    assert safetensors.torch.load_file(str(out)) == {}
    with zipslice.load(out) as lsd:
        assert len(lsd) == 0


def test_closed_checkpoint_refuses_reads(tmp_path):
    path, _ = _library_file(tmp_path)
    lsd = zipslice.load(path)
    lsd.close()
    with pytest.raises(ZipsliceError, match="closed"):
        lsd["scalar"]
    assert os.path.exists(path)


def test_file_truncated_after_opening(tmp_path):
    path, _ = _library_file(tmp_path)
    with zipslice.load(path) as lsd:
        last = max(lsd.infos(), key=lambda i: i.offset)
        with open(path, "r+b") as f:
            f.truncate(last.offset + 1)
        with pytest.raises(CorruptCheckpointError, match="truncated") as exc:
            lsd[last.name]
        assert exc.value.entry == last.name


def test_opening_reads_only_the_header_of_a_huge_sparse_file(tmp_path):
    """A 12 GiB file (sparse: no disk used) opens instantly; reading its last tensor is one positioned read."""
    big = 4 << 30
    header = {f"huge.{i}": {"dtype": "F32", "shape": [big // 4], "data_offsets": [i * big, (i + 1) * big]}
              for i in range(3)}
    header["small"] = {"dtype": "I64", "shape": [3], "data_offsets": [3 * big, 3 * big + 24]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    p = tmp_path / "sparse.safetensors"
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 3 * big)
        f.seek(0, 2)
        f.write(np.array([7, -8, 9], dtype="<i8").tobytes())
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with zipslice.load(p) as lsd:
        assert lsd.info("huge.2").nbytes == big
        assert lsd["small"].tolist() == [7, -8, 9]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: far below 12 GiB
