"""The torch zip reader against real torch.save files, compared bit for bit with torch.load(weights_only=True)."""
from __future__ import annotations

import os
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

import zipslice
from zipslice import dtypes, structure
from zipslice.errors import (CorruptCheckpointError, NotACheckpointError, UnsupportedCheckpointError,
                             ZipsliceError)
from zipslice.torch_legacy import LegacyTorchCheckpoint
from zipslice.torch_reader import TorchCheckpoint

from support.torch_compare import ALL_DTYPES, assert_same, assert_tree_same, bits, random_tensor

def save_and_check(obj, path, trusted=False, **save_kw):
    """``trusted``: compare with torch.load(weights_only=False) -- only for files this test just wrote, whose
    pickle uses opcodes torch's weights-only unpickler lacks (bytes, frames in protocols 3-5)."""
    torch.save(obj, path, **save_kw)
    want = torch.load(path, weights_only=not trusted)
    with zipslice.load(path, mmap=True) as lsd:  # the opt-in mapping mode gives the same tensors
        assert_tree_same(structure.build(lsd.structure, lsd.__getitem__), want)
    with zipslice.load(path) as lsd:
        got = structure.build(lsd.structure, lsd.__getitem__)
        assert_tree_same(got, want)
        for key in lsd:
            assert_same(lsd[key], _lookup(want, key), key)
        return lsd


def _lookup(obj, key):
    if key == "":
        return obj
    for part in key.split("/"):
        if isinstance(obj, dict):
            obj = obj[part] if part in obj else obj[int(part)]
        else:
            obj = obj[int(part)]
    return obj


# -- coverage --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_bit_for_bit(tmp_path, dtype):
    sd = {"x": random_tensor(dtype, (3, 5), seed=1), "scalar": random_tensor(dtype, (), seed=2),
          "empty": random_tensor(dtype, (0, 4)), "col": random_tensor(dtype, (6, 4), seed=3)[:, 1]}
    lsd = save_and_check(sd, tmp_path / "m.pt")
    assert lsd.info("x").dtype == dtype
    info = lsd.info("col")
    assert info.stride == (4,) and info.storage_offset == 1
    assert info.span_nbytes == (1 + 5 * 4) * dtypes.get(dtype).itemsize


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "complex128", "bool"])
def test_numpy_uses_ml_dtypes(tmp_path, dtype):
    t = random_tensor(dtype, (4, 3), seed=5)
    torch.save({"t": t}, tmp_path / "m.pt")
    with zipslice.load(tmp_path / "m.pt") as lsd:
        a = lsd.numpy("t")
        assert a.dtype == dtypes.get(dtype).to_numpy()
        assert a.tobytes() == bits(t)
        assert bytes(lsd.read_bytes("t")) == bits(t)


def test_zero_dim_and_empty(tmp_path):
    sd = {"zero_d": torch.tensor(3.5), "e1": torch.empty(0), "e2": torch.empty(3, 0, 2), "i0": torch.tensor(7)}
    lsd = save_and_check(sd, tmp_path / "m.pt")
    assert lsd.info("zero_d").shape == () and lsd.info("zero_d").span_nbytes == 4
    assert lsd.info("e2").span_nbytes == 0


def test_parameters_and_requires_grad(tmp_path):
    sd = {"p": torch.nn.Parameter(torch.randn(3, 2)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
          "leaf": torch.randn(4).requires_grad_(), "plain": torch.randn(2),
          "ip": torch.nn.Parameter(torch.arange(3), requires_grad=False)}
    lsd = save_and_check(sd, tmp_path / "m.pt")
    assert lsd.info("p").is_parameter and lsd.info("p").requires_grad
    assert lsd.info("frozen").is_parameter and not lsd.info("frozen").requires_grad
    assert not lsd.info("leaf").is_parameter and lsd.info("leaf").requires_grad
    with zipslice.load(tmp_path / "m.pt") as lsd:
        assert isinstance(lsd["p"], torch.nn.Parameter) and not isinstance(lsd["leaf"], torch.nn.Parameter)


def test_views_offsets_transposes_expands_gaps(tmp_path):
    big = torch.arange(48, dtype=torch.float64).reshape(6, 8)
    sd = {"big": big, "offset": big[2:], "t": big.t(), "gap": big[:, 2:4], "step": big[::2, ::3],
          "expanded": torch.arange(3.0).expand(4, 3), "row": big[3], "elem": big[5, 7]}
    lsd = save_and_check(sd, tmp_path / "m.pt")
    assert lsd.info("expanded").stride == (0, 1)
    info = lsd.info("gap")
    assert (info.storage_offset, info.stride, info.span_nbytes) == (2, (8, 1), (1 + 5 * 8 + 1) * 8)
    rec = lsd._storages[info.storage]
    assert info.offset == lsd._data_offset(rec) + 2 * 8


def test_strided_view_saved_without_its_base(tmp_path):
    big = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    lsd = save_and_check({"gap": big[:, 2:4]}, tmp_path / "m.pt")
    info = lsd.info("gap")
    assert info.storage_nbytes == 24 * 4 and info.span_nbytes == (1 + 3 * 6 + 1) * 4
    with zipslice.load(tmp_path / "m.pt") as lsd:
        t = lsd["gap"]
        assert t.untyped_storage().nbytes() == info.span_nbytes  # read only the span
        assert t.storage_offset() == 0


def test_real_module_state_dict_and_nested_containers(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "loss": 0.125,
            "nan": float("nan"), "tags": ["a", ("b", None, True)], "blob": b"\x00\x01raw", "shape": torch.Size([2, 3]),
            "dtype": torch.bfloat16, "device": torch.device("cpu"), 7: "int key"}
    lsd = save_and_check(ckpt, tmp_path / "ckpt.pt")
    assert "model/0.weight" in lsd and "optimizer/state/0/exp_avg" in lsd
    assert lsd.extras["epoch"] == 3 and lsd.extras["tags/1/0"] == "b" and lsd.extras["7"] == "int key"
    assert lsd.extras["optimizer/param_groups/0/lr"] == 0.001
    assert lsd.structure["dict"][0][1]["metadata"]["odict"][0][0] == ""
    assert lsd.extras["shape"] == {"torch": "size", "value": [2, 3]}
    assert lsd.info("model/1.num_batches_tracked").dtype == "int64"


def test_single_tensor_top_level(tmp_path):
    t = torch.randn(3, 3)
    lsd = save_and_check(t, tmp_path / "t.pt")
    assert list(lsd) == [""]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_protocols(tmp_path, protocol):
    model = torch.nn.Linear(5, 2)
    sd = {"sd": model.state_dict(), "u16": random_tensor("uint16", (3,)), "p": torch.nn.Parameter(torch.ones(2)),
          "bytes": b"abc" * 100, "long": 2**70, "neg": -(2**40), "f": 1.5, "s": "é" * 300}
    save_and_check(sd, tmp_path / "m.pt", trusted=protocol > 2, pickle_protocol=protocol)
    del sd["bytes"]
    if protocol == 2:  # protocol 2 writes bytes via _codecs.encode; weights-only torch must agree too
        save_and_check(sd, tmp_path / "m2.pt", pickle_protocol=protocol)


def test_renamed_file_keeps_old_prefix(tmp_path):
    torch.save({"w": torch.arange(5)}, tmp_path / "original_name.pt")
    os.rename(tmp_path / "original_name.pt", tmp_path / "renamed.bin")
    with zipslice.load(tmp_path / "renamed.bin") as lsd:
        assert lsd.prefix == "original_name/"
        assert torch.equal(lsd["w"], torch.arange(5))


def _rewrite(src, dst, transform=None, compress=zipfile.ZIP_STORED, order=None):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=compress) as zout:
        names = zin.namelist()
        for name in (order(names) if order else names):
            data = zin.read(name)
            zout.writestr(name, transform(name, data) if transform else data)


def test_entry_order_of_older_torch(tmp_path):
    # older torch wrote data.pkl, then data/*, then version; newer ones add .format_version etc. first
    torch.save({"a": torch.arange(4.0), "b": torch.ones(2, 2)}, tmp_path / "m.pt")
    _rewrite(tmp_path / "m.pt", tmp_path / "r.pt", order=lambda ns: sorted(ns, key=lambda n: "data.pkl" not in n)[::-1])
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    with zipslice.load(tmp_path / "r.pt") as lsd:
        for k in want:
            assert_same(lsd[k], want[k], k)


def _to_big_endian(src, dst) -> None:
    """Rewrite a little-endian torch file as a big-endian one (byteorder record + every storage swapped)."""
    from zipslice.torch_reader import swap_bytes

    with zipslice.load(src) as le:
        dtype_of = {le.info(k).storage: le.info(k).dtype for k in le}

    def to_big(name, data):
        if name.endswith("/byteorder"):
            return b"big"
        rec = name.split("/", 1)[1]
        if rec in dtype_of:
            a = np.frombuffer(data, dtype=np.uint8).copy()
            swap_bytes(a, dtype_of[rec])  # the same swap is its own inverse
            return a.tobytes()
        return data

    _rewrite(src, dst, to_big)


def test_big_endian_records(tmp_path):
    sd = {n: random_tensor(n, (3, 4), seed=i) for i, n in enumerate(["float32", "float64", "int16", "complex64",
                                                                       "complex128", "bfloat16", "uint8", "int64"])}
    sd["view"] = sd["float64"].t()
    torch.save(sd, tmp_path / "le.pt")
    _to_big_endian(tmp_path / "le.pt", tmp_path / "be.pt")
    want = torch.load(tmp_path / "be.pt", weights_only=True)  # torch's own big-endian path
    with zipslice.load(tmp_path / "be.pt", mmap=True) as lsd:
        for k in sd:
            assert_same(lsd[k], sd[k], k)
    with zipslice.load(tmp_path / "be.pt") as lsd:
        assert lsd.byteorder == "big" and lsd.info("float32").byteorder == "big"
        for k in sd:
            assert_same(lsd[k], want[k], k)
            assert_same(lsd[k], sd[k], k)
            if lsd.info(k).dtype != "bfloat16":
                assert lsd.numpy(k).tobytes() == bits(sd[k])


def _craft_zip64(members: list[tuple[str, bytes]], path) -> None:
    """A zip whose every size/offset lives in zip64 extra fields, with a zip64 end record and locator."""
    out = bytearray()
    central = bytearray()
    for name, data in members:
        raw = name.encode()
        crc = zlib.crc32(data)
        off = len(out)
        local_extra = struct.pack("<HHQQ", 1, 16, len(data), len(data))
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(raw),
                           len(local_extra)) + raw + local_extra + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), off)
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 45, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                               len(raw), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + raw + extra
    cd_off = len(out)
    out += central
    z64 = len(out)
    out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, len(members), len(members), len(central), cd_off)
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, z64, 1)
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    with open(path, "wb") as f:
        f.write(out)


def test_zip64_archive(tmp_path):
    sd = {"w": torch.randn(5, 3), "i": torch.arange(7), "v": torch.randn(4, 4)[1:, 2]}
    torch.save(sd, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        members = [(n, z.read(n)) for n in z.namelist()]
    _craft_zip64(members, tmp_path / "z64.pt")
    with zipfile.ZipFile(tmp_path / "z64.pt") as z:  # Python's zipfile agrees it is a valid zip64 archive
        assert z.testzip() is None
    want = torch.load(tmp_path / "z64.pt", weights_only=True)
    with zipslice.load(tmp_path / "z64.pt") as lsd:
        for k in sd:
            assert_same(lsd[k], want[k], k)
            assert_same(lsd[k], sd[k], k)


def test_zip64_local_headers_from_python_zipfile(tmp_path):
    torch.save({"w": torch.randn(8)}, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as zin, zipfile.ZipFile(tmp_path / "f.pt", "w") as zout:
        for n in zin.namelist():
            with zout.open(n, "w", force_zip64=True) as f:
                f.write(zin.read(n))
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    with zipslice.load(tmp_path / "f.pt") as lsd:
        assert_same(lsd["w"], want["w"])


def test_tied_weights_share_one_read(tmp_path):
    emb = torch.nn.Parameter(torch.randn(10, 4))
    big = torch.arange(24.0).reshape(4, 6)
    sd = {"embed": emb, "lm_head": emb, "big": big, "gap": big[:, 2:4], "alone": torch.ones(3)}
    lsd = save_and_check(sd, tmp_path / "m.pt")
    with zipslice.load(tmp_path / "m.pt") as lsd:
        assert lsd.info("embed").storage == lsd.info("lm_head").storage
        a, b = lsd["embed"], lsd["lm_head"]
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        g, bg = lsd["gap"], lsd["big"]
        assert g.untyped_storage().data_ptr() == bg.untyped_storage().data_ptr()
        bg[0, 2] = -1.0  # writes through, as with torch.load's shared storage
        assert g[0, 0].item() == -1.0
        assert g.storage_offset() - bg.storage_offset() == 2
        del a, b, g, bg
        fresh = lsd["gap"]  # no live view: read again from the file
        assert fresh[0, 0].item() == 2.0


def test_deflated_records_are_read_bounded(tmp_path):
    sd = {"w": torch.randn(100, 10), "z": torch.zeros(5000), "v": torch.randn(50, 4)[:, 1]}
    torch.save(sd, tmp_path / "m.pt")
    _rewrite(tmp_path / "m.pt", tmp_path / "d.pt", compress=zipfile.ZIP_DEFLATED)
    with zipslice.load(tmp_path / "d.pt") as lsd:
        assert lsd.info("w").offset is None
        for k in sd:
            assert_same(lsd[k], sd[k], k)
            assert lsd.numpy(k).tobytes() == bits(sd[k])


def test_encrypted_member_is_refused(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    data = bytearray((tmp_path / "m.pt").read_bytes())
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:  # set the "encrypted" flag in every central directory entry
        data[pos + 8] |= 1
        pos = data.find(b"PK\x01\x02", pos + 4)
    (tmp_path / "e.pt").write_bytes(bytes(data))
    with pytest.raises(UnsupportedCheckpointError, match="encrypted"):
        zipslice.load(tmp_path / "e.pt")


def test_lfs_pointer_gives_clear_error(tmp_path):
    p = tmp_path / "model.pt"
    p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "a" * 64 + "\nsize 12345\n")
    with pytest.raises(NotACheckpointError, match="Git LFS pointer"):
        zipslice.load(p)


def test_metadata_only_on_open_and_closing(tmp_path):
    torch.save({"w": torch.randn(4, 4)}, tmp_path / "m.pt")
    lsd = zipslice.load(tmp_path / "m.pt")
    assert isinstance(lsd, TorchCheckpoint) and lsd.format == "torch"
    info = lsd.info("w")
    assert (info.dtype, info.shape, info.stride, info.storage, info.storage_nbytes) == (
        "float32", (4, 4), (4, 1), "data/0", 64)
    with open(tmp_path / "m.pt", "rb") as f:
        f.seek(info.offset)
        assert f.read(64) == bits(torch.load(tmp_path / "m.pt", weights_only=True)["w"])
    lsd.close()
    with pytest.raises(ZipsliceError, match="closed"):
        lsd["w"]


# -- legacy format -----------------------------------------------------------------------------------

def test_legacy_format(tmp_path):
    big = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"big": big, "gap": big[:, 2:4], "h": random_tensor("float16", (5,)), "p": torch.nn.Parameter(torch.ones(3)),
          "nested": {"l": [torch.arange(3), 4]}, "bf": random_tensor("bfloat16", (2, 2))}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    want = torch.load(path, weights_only=True)
    with zipslice.load(path) as lsd:
        assert isinstance(lsd, LegacyTorchCheckpoint) and lsd.format == "torch-legacy"
        assert_tree_same(structure.build(lsd.structure, lsd.__getitem__), want)
        g, b = lsd["gap"], lsd["big"]
        assert g.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_legacy_any_pickle_protocol(tmp_path, protocol):
    sd = {"w": torch.randn(3, 4), "b": torch.arange(5), "n": 7}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    assert zipslice.sniff(path) == "torch-legacy"
    # torch's weights_only unpickler refuses some of these protocols; the file is our own, so trust it
    want = torch.load(path, weights_only=False)
    with zipslice.load(path) as lsd:
        assert_tree_same(structure.build(lsd.structure, lsd.__getitem__), want)


def test_legacy_protocol_0_recognised_and_refused(tmp_path):
    # protocol 0 pickles persistent ids as text; torch.load itself cannot read such a file
    path = tmp_path / "legacy0.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False, pickle_protocol=0)
    assert zipslice.sniff(path) == "torch-legacy"
    with pytest.raises(UnsupportedCheckpointError, match="protocol 0"):
        zipslice.load(path)


def test_legacy_truncated(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.randn(100)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    for cut in (len(data) - 10, len(data) // 3 * 2, 60):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError):
            zipslice.load(tmp_path / "cut.pt")


@pytest.mark.slow
def test_zip64_over_4gib(tmp_path):
    n = (4 << 30) + 4096
    t = torch.empty(n, dtype=torch.uint8)
    t[:16] = torch.arange(16, dtype=torch.uint8)
    t[-16:] = torch.arange(16, 32, dtype=torch.uint8)
    small = torch.randn(3)
    path = tmp_path / "huge.pt"
    torch.save({"huge": t, "small": small}, path)
    del t
    with zipslice.load(path) as lsd:
        assert lsd.info("huge").storage_nbytes == n
        assert_same(lsd["small"], small)
        with zipfile.ZipFile(path) as z:
            zi = z.getinfo(lsd.prefix + "data/0")
            assert zi.file_size == n
        fd = os.open(path, os.O_RDONLY)
        try:
            tail = os.pread(fd, 16, lsd.info("huge").offset + n - 16)
            head = os.pread(fd, 16, lsd.info("huge").offset)
        finally:
            os.close(fd)
        assert head == bytes(range(16)) and tail == bytes(range(16, 32))


# -- file-level metadata and layout round trips --------------------------------------------------------

def test_metadata_record_round_trip(tmp_path):
    from zipslice import torch_writer
    from zipslice.sources import as_sources

    p = tmp_path / "m.pt"
    meta = {"format": "pt", "note": "ünïcode", "empty": ""}
    torch_writer.write(p, as_sources({"x": torch.arange(3.0)}), metadata=meta)
    with zipslice.load(p) as lsd:
        assert lsd.metadata == meta
        assert "x" in lsd and ".data/zipslice_metadata.json" not in lsd.extras
        again = tmp_path / "again.pt"
        zipslice.save(again, lsd)
    with zipslice.load(again) as lsd:
        assert lsd.metadata == meta
    torch.save({"x": torch.ones(1)}, tmp_path / "plain.pt")
    with zipslice.load(tmp_path / "plain.pt") as lsd:
        assert lsd.metadata == {}


@pytest.mark.parametrize("payload", [b"[1, 2]", b'{"a": 1}', b"{not json", b"\xff\xfe", b'{"a": ["b"]}'])
def test_bad_metadata_record_is_corrupt(tmp_path, payload):
    p = tmp_path / "bad.pt"
    torch.save({"x": torch.ones(2)}, p)
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("bad/.data/zipslice_metadata.json", payload)
    with pytest.raises(CorruptCheckpointError, match="metadata") as e:
        zipslice.load(p)
    assert "zipslice_metadata.json" in str(e.value)


@pytest.mark.parametrize("flat", ["safetensors", "h5"])
def test_save_through_a_flat_format_restores_the_layout(tmp_path, flat):
    emb = torch.nn.Parameter(random_tensor("float32", (4, 3)))
    sd = {"model": {"embed.weight": emb, "head.weight": emb, "bias": torch.arange(3.0)},
          "step": 12, "opt": [{"lr": 0.5}]}
    src = tmp_path / "src.pt"
    torch.save(sd, src)
    mid = tmp_path / f"mid.{flat}"
    back = tmp_path / "back.pt"
    with zipslice.load(src) as lsd:
        zipslice.save(mid, lsd)
    with zipslice.load(mid) as lsd:
        assert lsd.structure is None and "zipslice.layout" in lsd.metadata
        zipslice.save(back, lsd)
    got = torch.load(back, weights_only=True)
    assert_tree_same(got, torch.load(src, weights_only=True))
    m = got["model"]
    assert isinstance(m["embed.weight"], torch.nn.Parameter)
    assert m["embed.weight"].untyped_storage().data_ptr() == m["head.weight"].untyped_storage().data_ptr()
    with zipslice.load(back) as lsd:
        assert "zipslice.layout" not in lsd.metadata


# -- read-ahead while streaming -----------------------------------------------------------------------

@pytest.fixture
def read_ahead_on(monkeypatch):
    """The read-ahead thread is off by default; these tests exercise it."""
    from zipslice.torch_reader import TorchCheckpoint

    monkeypatch.setattr(TorchCheckpoint, "read_ahead", True)


def _big_checkpoint(tmp_path, n=5):
    # each tensor above the read-ahead threshold (4 MiB), distinct contents and sizes
    sd = {f"layer{i}.weight": random_tensor("float32", (1024 * 1024 + 4096 * i,), seed=i) for i in range(n)}
    sd["small"] = torch.arange(10)
    sd["after"] = random_tensor("float16", (3 * 1024 * 1024,), seed=99)
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    return path, sd


def test_streaming_in_order_reads_ahead_and_is_exact(tmp_path, read_ahead_on):
    path, sd = _big_checkpoint(tmp_path)
    with zipslice.load(path) as lsd:
        used = 0
        for k in lsd:
            t = lsd[k]
            assert_same(t, sd[k], k)
            used += lsd._read_ahead is not None
            del t
        assert used >= 3  # the read-ahead really ran: this test covers it
        for k, t in lsd.items():  # the Mapping view keeps the previous tensor alive while fetching the next
            assert_same(t, sd[k], k)


def test_read_ahead_never_reuses_a_buffer_still_in_use(tmp_path, read_ahead_on):
    path, sd = _big_checkpoint(tmp_path)
    with zipslice.load(path) as lsd:
        held = list(lsd.values())  # every tensor kept: the pool must hand out fresh memory
        for k, t in zip(lsd, held):
            assert_same(t, sd[k], k)
        ptrs = [t.untyped_storage().data_ptr() for t in held]
        assert len(set(ptrs)) == len(ptrs)
        held[0].add_(1)  # writing one must not change another
        for k, t in list(zip(lsd, held))[1:]:
            assert_same(t, sd[k], k)


def test_read_ahead_cancelled_by_random_access_and_close(tmp_path, read_ahead_on):
    path, sd = _big_checkpoint(tmp_path)
    keys = list(sd)
    lsd = zipslice.load(path)
    assert_same(lsd[keys[0]], sd[keys[0]])
    assert_same(lsd[keys[1]], sd[keys[1]])  # in order: keys[2] is being read ahead
    assert lsd._read_ahead is not None and lsd._read_ahead.key == keys[2]
    assert_same(lsd[keys[4]], sd[keys[4]])  # elsewhere: the read-ahead is dropped
    assert_same(lsd[keys[2]], sd[keys[2]])
    assert_same(lsd[keys[3]], sd[keys[3]])
    lsd.close()  # with a read-ahead of keys[4] possibly in flight
    with pytest.raises(ZipsliceError, match="closed"):
        lsd[keys[4]]


def test_read_ahead_failure_surfaces_in_the_callers_read(tmp_path, read_ahead_on):
    path, sd = _big_checkpoint(tmp_path, n=3)
    keys = list(sd)
    lsd = zipslice.load(path)
    last = lsd.info(keys[2])
    lsd[keys[0]]
    os.truncate(path, last.offset + 100)  # the third tensor is now cut short, while it is read ahead
    lsd[keys[1]]
    with pytest.raises(CorruptCheckpointError, match="truncated|end of file"):
        lsd[keys[2]]
    lsd.close()


def test_mmap_mode_is_private_and_outlives_close(tmp_path):
    path, sd = _big_checkpoint(tmp_path, n=2)
    before = path.read_bytes()
    with zipslice.load(path, mmap=True) as lsd:
        held = {k: lsd[k] for k in lsd}
        for k, t in held.items():
            assert_same(t, sd[k], k)
        held["layer0.weight"][:1000] = 12345.0  # copy-on-write: never reaches the file
    assert path.read_bytes() == before
    for k in ("layer1.weight", "after", "small"):
        assert_same(held[k], sd[k], k)  # still valid after close
    assert bool((held["layer0.weight"][:1000] == 12345.0).all())
    assert bits(held["layer0.weight"][1000:]) == bits(sd["layer0.weight"][1000:])
    legacy = tmp_path / "legacy.pt"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    with zipslice.load(legacy, mmap=True) as lsd:
        for k in lsd:
            assert_same(lsd[k], sd[k], k)
    st = tmp_path / "x.safetensors"
    zipslice.save(st, {"a": torch.ones(2)})
    with pytest.raises(ValueError, match="mmap"):
        zipslice.load(st, mmap=True)


def test_local_headers_are_read_lazily(tmp_path):
    sd = {"a": torch.arange(6.0), "b": torch.arange(4, dtype=torch.int16)}
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    with zipfile.ZipFile(path) as z:
        hoff = z.getinfo("m/data/0").header_offset
        want = {k: z.getinfo(f"m/data/{i}").header_offset for i, k in enumerate(sd)}
    with zipslice.load(path) as lsd:  # offsets from the local headers, in one batch or one by one
        batch = {i.name: i.offset for i in lsd.infos()}
    with zipslice.load(path) as lsd:
        assert batch == {k: lsd.info(k).offset for k in lsd}
        for k, off in batch.items():
            assert off > want[k] and path.read_bytes()[off:off + 2] == bits(sd[k])[:2]
    data = bytearray(path.read_bytes())
    assert data[hoff:hoff + 4] == b"PK\x03\x04"
    data[hoff:hoff + 4] = b"XXXX"  # break the first record's local header: opening does not look at it
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    with zipslice.load(tmp_path / "bad.pt") as lsd:
        assert list(lsd) == ["a", "b"]
        assert_same(lsd["b"], sd["b"])
        with pytest.raises(CorruptCheckpointError, match="no local file header") as e:
            lsd.info("a")
        assert "data/0" in str(e.value)
        with pytest.raises(CorruptCheckpointError, match="no local file header"):
            lsd["a"]


def test_read_ahead_of_big_endian_records(tmp_path, read_ahead_on):
    path, sd = _big_checkpoint(tmp_path, n=3)
    _to_big_endian(path, tmp_path / "be.pt")
    with zipslice.load(tmp_path / "be.pt") as lsd:
        used = 0
        for k in lsd:
            assert_same(lsd[k], sd[k], k)
            used += lsd._read_ahead is not None
        assert used >= 2


@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("how", ["items", "getitem"])
def test_streaming_holds_at_most_two_buffers(tmp_path, how, read_ahead, monkeypatch):
    from zipslice.torch_reader import TorchCheckpoint

    monkeypatch.setattr(TorchCheckpoint, "read_ahead", read_ahead)
    sd = {f"w{i}": random_tensor("float32", (1280 * 1024,), seed=i) for i in range(8)}  # 5 MiB each
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    ptrs = set()
    with zipslice.load(path) as lsd:
        if how == "items":
            for k, t in lsd.items():  # the previous tensor is alive while the next one is fetched
                assert_same(t, sd[k], k)
                ptrs.add(t.untyped_storage().data_ptr())
        else:
            for k in lsd:
                t = lsd[k]
                assert_same(t, sd[k], k)
                ptrs.add(t.untyped_storage().data_ptr())
                del t
    assert len(ptrs) <= 2  # the caller's tensor and the one read ahead, reused turn by turn


@pytest.mark.parametrize("read_ahead", [True, False])
def test_pooled_buffer_is_never_reused_while_a_view_lives(tmp_path, read_ahead, monkeypatch):
    from zipslice.torch_reader import TorchCheckpoint

    monkeypatch.setattr(TorchCheckpoint, "read_ahead", read_ahead)
    path, sd = _big_checkpoint(tmp_path)
    keys = [k for k in sd if k.startswith("layer")]
    with zipslice.load(path) as lsd:
        views = {}
        for k in keys:
            t = lsd[k]
            views[k] = t[7:]  # only a view survives: it still pins the pooled buffer
            del t
        for k in keys:  # later reads (into recycled buffers) never overwrote a live view's bytes
            assert bits(views[k]) == bits(sd[k][7:]), k
        ptrs = {v.untyped_storage().data_ptr() for v in views.values()}
        assert len(ptrs) == len(keys)
        views.clear()
        again = [lsd[k].untyped_storage().data_ptr() for k in keys]  # each dropped at once: recycled
        assert len(set(again)) <= 2


def test_local_headers_stay_lazy_for_a_random_read_and_come_in_one_batch_in_order(tmp_path):
    path = tmp_path / "m.pt"
    sd = {f"w{i}": torch.full((64,), float(i)) for i in range(8)}
    torch.save(sd, path)
    with zipslice.load(path) as lsd:
        keys = list(lsd)
        assert len(lsd._unresolved) == 8  # opening reads no local header
        assert torch.equal(lsd[keys[5]], sd[keys[5]])
        assert len(lsd._unresolved) == 7  # a random read resolves its own header only
        assert torch.equal(lsd[keys[2]], sd[keys[2]])
        assert len(lsd._unresolved) == 6  # still random
        assert torch.equal(lsd[keys[3]], sd[keys[3]])  # the key after the last one read: in order
        assert not lsd._unresolved
        for k in keys:  # and every read is still exact
            assert torch.equal(lsd[k], sd[k])
    with zipslice.load(path) as lsd:
        lsd.numpy(keys[0])  # the first key counts as in order; numpy()/read_bytes() take part too
        assert not lsd._unresolved
