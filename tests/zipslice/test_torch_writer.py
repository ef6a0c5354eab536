"""The streaming torch writer, checked against torch's own loader and torch.save's own layout."""
import math
import os
import struct
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from zipslice import dtypes, torch_writer
from zipslice.errors import ZipsliceError
from zipslice.info import TensorSource
from zipslice.sources import as_sources

LOADS = [dict(weights_only=True), dict(weights_only=True, mmap=True)]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(dtype: str, shape=(3, 5), seed=0) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs and infs included for floats)."""
    n = math.prod(shape) * dtypes.get(dtype).itemsize
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
    if dtype == "bool":
        raw = raw % 2
    return raw.view(getattr(torch, dtype)).reshape(shape)


@pytest.mark.parametrize("load_kw", LOADS)
def test_every_dtype_loads_bit_for_bit(tmp_path, load_kw):
    tensors = {name: _random(name, seed=i) for i, name in enumerate(dtypes.BY_NAME)}
    p = tmp_path / "all.pt"
    torch_writer.write(p, as_sources(tensors))
    got = torch.load(p, **load_kw)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert _bits(got[name]) == _bits(t), name


def test_scalar_empty_and_large_shapes(tmp_path):
    tensors = {"scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "wide": torch.arange(300).reshape(1, 300),
               "nonc": torch.arange(12.).reshape(3, 4).t()}
    p = tmp_path / "s.pt"
    torch_writer.write(p, as_sources(tensors))
    for kw in LOADS:
        got = torch.load(p, **kw)
        for k, t in tensors.items():
            assert got[k].shape == t.shape and torch.equal(got[k], t), k
            assert got[k].is_contiguous()


@pytest.mark.parametrize("load_kw", LOADS)
def test_tied_parameters_share_one_storage(tmp_path, load_kw):
    emb = torch.nn.Parameter(torch.randn(10, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    grad_tensor = torch.ones(3, requires_grad=True)
    p = tmp_path / "tied.pt"
    torch_writer.write(p, as_sources([("embed", emb), ("bias", frozen), ("g", grad_tensor), ("head", emb)]))
    with zipfile.ZipFile(p) as z:
        assert sorted(n for n in z.namelist() if "/data/" in n) == ["tied/data/0", "tied/data/1", "tied/data/2"]
    got = torch.load(p, **load_kw)
    assert isinstance(got["embed"], torch.nn.Parameter) and got["embed"].requires_grad
    assert isinstance(got["bias"], torch.nn.Parameter) and not got["bias"].requires_grad
    assert type(got["g"]) is torch.Tensor and got["g"].requires_grad
    assert got["head"].untyped_storage().data_ptr() == got["embed"].untyped_storage().data_ptr()
    assert torch.equal(got["head"], emb)


def test_nested_structure_and_plain_leaves(tmp_path):
    w, b = torch.randn(4, 3), torch.randn(4)
    structure = {"dict": [
        ["model", {"odict": [["layer.weight", {"tensor": "model/layer.weight"}],
                             ["layer.bias", {"tensor": "model/layer.bias"}]],
                   "metadata": {"odict": [["", {"dict": [["version", {"value": 1}]]}]]}}],
        ["epoch", {"value": 7}], ["lr", {"float": (1e-3).hex()}], ["inf", {"float": float("inf").hex()}],
        ["big", {"value": 2 ** 70}], ["neg", {"value": -(2 ** 40)}], ["name", {"value": "ünïcode"}],
        ["none", {"value": None}], ["flag", {"value": False}], ["blob", {"bytes": "AAH/"}],
        ["history", {"list": [{"value": 1}, {"tuple": [{"value": "a"}, {"float": (2.5).hex()}]}, {"list": []}]}],
        ["t4", {"tuple": [{"value": i} for i in range(5)]}],
        [3, {"value": "int key"}],
        ["dtype", {"torch": "dtype", "value": "bfloat16"}], ["size", {"torch": "size", "value": [2, 3]}],
        ["device", {"torch": "device", "value": "cpu"}],
    ]}
    p = tmp_path / "nested.pt"
    torch_writer.write(p, as_sources([("model/layer.weight", w), ("model/layer.bias", b)]), structure=structure)
    for kw in LOADS:
        got = torch.load(p, **kw)
        model = got["model"]
        assert type(model) is OrderedDict and list(model) == ["layer.weight", "layer.bias"]
        assert model._metadata == {"": {"version": 1}}
        assert torch.equal(model["layer.weight"], w) and torch.equal(model["layer.bias"], b)
        rest = {k: v for k, v in got.items() if k != "model"}
        assert rest == {"epoch": 7, "lr": 1e-3, "inf": float("inf"), "big": 2 ** 70, "neg": -(2 ** 40),
                        "name": "ünïcode", "none": None, "flag": False, "blob": b"\x00\x01\xff",
                        "history": [1, ("a", 2.5), []], "t4": (0, 1, 2, 3, 4), 3: "int key",
                        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu")}
        assert isinstance(got["size"], torch.Size)


def test_layout_matches_torch_save(tmp_path):
    t = {"a": torch.randn(5, 7), "b": torch.arange(3, dtype=torch.int64)}
    ours, theirs = tmp_path / "ours" / "m.pt", tmp_path / "theirs" / "m.pt"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    torch_writer.write(ours, as_sources(t))
    torch.save(t, theirs)
    with zipfile.ZipFile(ours) as zo, zipfile.ZipFile(theirs) as zt:
        assert zo.namelist() == zt.namelist()
        for name in zo.namelist():
            if name.endswith(("data.pkl", "serialization_id")):
                continue
            assert zo.read(name) == zt.read(name), name
        assert zo.testzip() is None
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zo.infolist())
    # every record's data starts on a 64-byte boundary, as torch's mmap loading expects
    raw = ours.read_bytes()
    with zipfile.ZipFile(ours) as zo:
        for info in zo.infolist():
            n, e = struct.unpack_from("<HH", raw, info.header_offset + 26)
            assert (info.header_offset + 30 + n + e) % 64 == 0, info.filename


def test_output_is_deterministic(tmp_path):
    t = as_sources({"x": torch.randn(100), "y": torch.ones(3, dtype=torch.bfloat16)})
    torch_writer.write(tmp_path / "a.pt", t)
    torch_writer.write(tmp_path / "b.pt", t, record_prefix="a")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_forced_zip64_loads_everywhere(tmp_path):
    t = {"w": torch.randn(64, 3), "u": torch.arange(4).to(torch.uint32)}
    p = tmp_path / "z64.pt"
    torch_writer.write(p, as_sources(t), force_zip64=True)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
    raw = p.read_bytes()
    assert struct.pack("<I", 0x06064B50) in raw  # zip64 end of central directory
    for kw in LOADS:
        got = torch.load(p, **kw)
        assert all(torch.equal(got[k], v) for k, v in t.items())


def test_metadata_is_kept_in_an_extra_record(tmp_path):
    p = tmp_path / "meta.pt"
    torch_writer.write(p, as_sources({"x": torch.ones(2)}), metadata={"format": "pt", "note": "hi"})
    with zipfile.ZipFile(p) as z:
        assert z.read("meta/.data/zipslice_metadata.json") == b'{"format": "pt", "note": "hi"}'
    assert torch.equal(torch.load(p, weights_only=True)["x"], torch.ones(2))


def _src(name, data: bytes, dtype="uint8", shape=None, fail=False):
    def read():
        if fail:
            raise OSError("disk went away")
        return data
    return TensorSource(name=name, dtype=dtype, shape=shape or (len(data),), read=read)


def test_failure_leaves_destination_untouched(tmp_path):
    p = tmp_path / "keep.pt"
    p.write_bytes(b"old content")
    with pytest.raises(OSError, match="disk went away"):
        torch_writer.write(p, [_src("a", b"abc"), _src("b", b"xyz", fail=True)])
    assert p.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["keep.pt"]


def test_errors_name_file_and_entry(tmp_path):
    p = tmp_path / "bad.pt"
    with pytest.raises(ZipsliceError, match=r"bad\.pt \[short\].*gave 2 bytes, expected 4"):
        torch_writer.write(p, [_src("short", b"ab", shape=(4,))])
    with pytest.raises(ZipsliceError, match=r"\[ghost\].*no source provides"):
        torch_writer.write(p, [_src("a", b"a")], structure={"dict": [["g", {"tensor": "ghost"}]]})
    with pytest.raises(ZipsliceError, match="do not appear in the structure"):
        torch_writer.write(p, [_src("a", b"a"), _src("b", b"b")], structure={"dict": [["a", {"tensor": "a"}]]})
    with pytest.raises(ZipsliceError, match=r"\[a\].*two sources"):
        torch_writer.write(p, [_src("a", b"a"), _src("a", b"b")])
    tied = [_src("a", b"ab"), _src("b", b"abcd")]
    tied[0].tie = tied[1].tie = "same"
    with pytest.raises(ZipsliceError, match=r"\[b\].*tied to 'a'"):
        torch_writer.write(p, tied)
    assert not p.exists() and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_more_than_65535_records_uses_zip64(tmp_path):
    srcs = [_src(f"t{i}", bytes([i % 256])) for i in range(70_000)]
    p = tmp_path / "many.pt"
    torch_writer.write(p, srcs)
    got = torch.load(p, weights_only=True, mmap=True)
    assert len(got) == 70_000 and got["t69999"].item() == 69_999 % 256


@pytest.mark.slow
def test_record_beyond_4_gib(tmp_path_factory):
    big = 4 * 2 ** 30 + 4096
    d = tmp_path_factory.mktemp("big")
    p = d / "big.pt"
    head = np.zeros(big, dtype=np.uint8)
    head[-3:] = [1, 2, 3]
    torch_writer.write(p, [TensorSource("small", "float32", (2,), lambda: np.ones(2, "<f4")),
                           TensorSource("huge", "uint8", (big,), lambda: head),
                           TensorSource("after", "int64", (1,), lambda: np.array([42], "<i8"))])
    del head
    got = torch.load(p, weights_only=True, mmap=True)
    assert got["huge"][-3:].tolist() == [1, 2, 3] and got["after"].item() == 42
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("big/data/2").header_offset > 2 ** 32
    os.unlink(p)


def _hinted(name: str, values: np.ndarray, crc) -> TensorSource:
    return TensorSource(name=name, dtype="float32", shape=values.shape, read=lambda: values.tobytes(), crc32=crc)


def test_a_source_that_knows_its_crc_is_trusted_and_one_that_does_not_is_computed(tmp_path):
    import zlib

    a = np.arange(1000, dtype=np.float32)
    b = np.arange(500, dtype=np.float32) * 3
    good = tmp_path / "good.pt"
    torch_writer.write(good, [_hinted("a", a, lambda: zlib.crc32(a.tobytes())), _hinted("b", b, lambda: None)])
    assert zipfile.ZipFile(good).testzip() is None  # every record's CRC matches its bytes
    got = torch.load(good, weights_only=True)
    assert np.array_equal(got["a"].numpy(), a) and np.array_equal(got["b"].numpy(), b)
    # the hint is what the writer records (not recomputed): a wrong one is caught by any zip reader
    bad = tmp_path / "bad.pt"
    torch_writer.write(bad, [_hinted("a", a, lambda: 12345)])
    assert zipfile.ZipFile(bad).testzip() == "bad/data/0"


def _chunked(sources, piece: int):
    """The same sources, each also offering its bytes as pieces of ``piece`` bytes (TensorSource.chunks)."""
    import dataclasses

    out = []
    for s in sources:
        def chunks(s=s):
            view = memoryview(bytes(torch_writer.source_bytes(s)))
            for i in range(0, view.nbytes, piece):
                yield view[i:i + piece]
        out.append(dataclasses.replace(s, chunks=chunks))
    return out


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_chunks_on_a_seekable_file_write_the_same_bytes(tmp_path, piece):
    tensors = {name: _random(name, shape=(33, 17), seed=i) for i, name in enumerate(dtypes.BY_NAME)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole, chunked = tmp_path / "a" / "model.pt", tmp_path / "b" / "model.pt"  # same name: same record prefix
    torch_writer.write(whole, as_sources(tensors))
    torch_writer.write(chunked, _chunked(as_sources(tensors), piece))
    assert chunked.read_bytes() == whole.read_bytes()  # CRCs patched in: the same file
    with zipfile.ZipFile(chunked) as z:
        assert z.testzip() is None  # every record's CRC matches its bytes


def test_chunks_are_ignored_on_a_stream_that_cannot_seek(tmp_path):
    import io

    class Pipe(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += b
            return len(b)

    def never():
        raise AssertionError("chunks() called on a stream that cannot seek")
        yield

    tensors = {"w": _random("float32", shape=(64, 8))}
    srcs = [__import__("dataclasses").replace(s, chunks=never) for s in as_sources(tensors)]
    pipe = Pipe()
    torch_writer.write_to(pipe, srcs, record_prefix="whole")
    torch_writer.write(tmp_path / "whole.pt", as_sources(tensors))
    assert bytes(pipe.data) == (tmp_path / "whole.pt").read_bytes()


@pytest.mark.parametrize("delta", [-1, 1])
def test_chunks_that_do_not_add_up_to_the_tensor_are_refused(tmp_path, delta):
    import dataclasses

    src = as_sources({"w": _random("float32", shape=(10,))})[0]
    data = bytes(torch_writer.source_bytes(src))
    bad = dataclasses.replace(src, chunks=lambda: iter([data[:len(data) + delta] if delta < 0 else data + b"x"]))
    with pytest.raises(ZipsliceError, match="announced"):
        torch_writer.write(tmp_path / "bad.pt", [bad])
    assert not (tmp_path / "bad.pt").exists()
