"""HDF5: files written by h5py (plain, chunked/compressed, Keras 2 and Keras 3 layouts) read through zipslice
bit for bit, and our writer's output read back by h5py."""
from __future__ import annotations

import h5py
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import zipslice
from zipslice import dtypes
from zipslice.errors import CorruptCheckpointError, UnsupportedCheckpointError, ZipsliceError
from zipslice.hdf5_format import DTYPE_ATTR, HDF5Checkpoint
from zipslice.info import TensorSource

NATIVE = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]


def _array(dtype_name: str, shape, seed: int, byteorder: str = "<") -> np.ndarray:
    g = np.random.default_rng(seed)
    dt = dtypes.get(dtype_name)
    n = int(np.prod(shape))
    if dt.name == "bool":
        return g.integers(0, 2, n).astype(bool).reshape(shape)
    raw = g.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    a = raw.view(dt.carrier).view(dt.to_numpy()).reshape(shape)
    return a.astype(a.dtype.newbyteorder(byteorder)) if byteorder == ">" and dt.itemsize > 1 else a


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    want = np.array(want, order="C")  # (ascontiguousarray would turn a scalar into shape (1,))
    if want.dtype.byteorder == ">":
        want = want.astype(want.dtype.newbyteorder("<"))
    return got.shape == want.shape and got.tobytes() == want.tobytes()


def test_every_native_dtype_matches_h5py_bit_for_bit(tmp_path):
    p = tmp_path / "plain.h5"
    want = {}
    with h5py.File(p, "w") as f:
        for i, d in enumerate(NATIVE):
            for order in "<>":
                name = f"{d}{'_be' if order == '>' else ''}"
                want[name] = _array(d, (3, 4), i, order)
                f.create_dataset(name, data=want[name])
        f.create_dataset("scalar", data=np.float32(2.5))
        f.create_dataset("nested/group/w", data=np.arange(5, dtype="<i2"))
    assert zipslice.sniff(p) == "hdf5"
    with zipslice.load(p) as lsd, h5py.File(p, "r") as ref:
        assert isinstance(lsd, HDF5Checkpoint) and lsd.layout == "plain"
        assert "nested/group/w" in lsd and lsd.info("scalar").shape == ()
        for name in lsd:
            info = lsd.info(name)
            assert info.offset == ref[name].id.get_offset() and info.offset is not None, name
            assert info.byteorder == ("big" if name.endswith("_be") and info.itemsize > 1 else "little")
            assert _same(lsd.numpy(name), ref[name][()]), name
            t = lsd[name]
            assert t.shape == ref[name].shape
            assert _same(t.numpy(), ref[name][()]), name


def test_chunked_compressed_unallocated_and_compact_datasets(tmp_path):
    p = tmp_path / "layouts.h5"
    a = np.arange(1000, dtype="<f4").reshape(10, 100)
    with h5py.File(p, "w") as f:
        f.create_dataset("gzip", data=a, chunks=(3, 30), compression="gzip", shuffle=True)
        f.create_dataset("chunked_be", data=a.astype(">f8"), chunks=(5, 5))
        f.create_dataset("never_written", shape=(4, 2), dtype="<i4", fillvalue=-7)
        f.create_dataset("empty", shape=(0, 3), dtype="<f4")
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        f.create_dataset("compact", data=np.arange(6, dtype="<u2"), dcpl=dcpl)
    with zipslice.load(p) as lsd, h5py.File(p, "r") as ref:
        for name in ("gzip", "chunked_be", "never_written", "compact"):
            assert lsd.info(name).offset is None, name
            assert _same(lsd.numpy(name), ref[name][()]), name
        assert lsd.numpy("never_written").tolist() == [[-7, -7]] * 4
        assert lsd["empty"].shape == (0, 3)
        assert torch.equal(lsd["gzip"], torch.from_numpy(a))


def test_userblock_offsets_are_absolute(tmp_path):
    p = tmp_path / "ub.h5"
    with h5py.File(p, "w", userblock_size=1024) as f:
        f.create_dataset("w", data=np.arange(8, dtype="<f8"))
    blob = p.read_bytes()
    with zipslice.load(p) as lsd:
        info = lsd.info("w")
        assert blob[info.offset:info.offset + info.span_nbytes] == np.arange(8, dtype="<f8").tobytes()
        assert lsd.numpy("w").tolist() == list(range(8))


def test_links_strings_and_non_tensors(tmp_path):
    p = tmp_path / "links.h5"
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("secret", data=np.arange(3))
    with h5py.File(p, "w", track_order=True) as f:
        f.create_dataset("w", data=np.arange(4, dtype="<f4"))
        f["again"] = f["w"]                      # hard link: the same dataset twice
        f["soft"] = h5py.SoftLink("/w")
        f["ext"] = h5py.ExternalLink(str(other), "/secret")
        f.create_dataset("label", data="hello")
        f.attrs["framework"] = "test"
        f.attrs["version"] = np.bytes_(b"1.2")
        f.attrs["count"] = 3
    with zipslice.load(p) as lsd:
        assert list(lsd) == ["w", "again"]
        assert lsd.info("again").storage == lsd.info("w").storage == "w"
        assert lsd.source("again").tie == lsd.source("w").tie
        assert set(lsd.skipped) == {"soft", "ext"}
        assert lsd.extras == {"label": "hello"}
        assert lsd.metadata == {"framework": "test", "version": "1.2"}


def test_external_storage_is_refused(tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(4, dtype="<f4").tobytes())
    p = tmp_path / "efl.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("w", shape=(4,), dtype="<f4", external=[(str(raw), 0, 16)])
    with pytest.raises(UnsupportedCheckpointError, match="other files") as exc:
        zipslice.load(p)
    assert exc.value.entry == "w"


def test_truncated_file_is_corrupt(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("w", data=np.arange(1000, dtype="<f4"))
    p.write_bytes(p.read_bytes()[:600])
    with pytest.raises(CorruptCheckpointError, match="h5py cannot open"):
        zipslice.load(p)


# -- Keras layouts, built with h5py exactly as Keras writes them ---------------------------------------

def _keras2(path, full_model: bool, split_layer_names: bool = False):
    """Keras 2: model.save(".h5") puts weights under model_weights/; save_weights(".h5") at the root."""
    kernel, bias = _array("float32", (4, 3), 1), _array("float32", (3,), 2)
    gamma = _array("float32", (3,), 3)
    with h5py.File(path, "w") as f:
        root = f.create_group("model_weights") if full_model else f
        layers = [b"dense", b"dropout", b"batch_norm"]
        if split_layer_names:  # Keras splits attributes over 64 KiB into layer_names0, layer_names1, ...
            root.attrs["layer_names0"] = layers[:2]
            root.attrs["layer_names1"] = layers[2:]
        else:
            root.attrs["layer_names"] = layers
        root.attrs["backend"] = b"tensorflow"
        root.attrs["keras_version"] = b"2.15.0"
        g = root.create_group("dense")
        g.attrs["weight_names"] = [b"dense/kernel:0", b"dense/bias:0"]
        g.create_dataset("dense/kernel:0", data=kernel)
        g.create_dataset("dense/bias:0", data=bias)
        root.create_group("dropout").attrs["weight_names"] = np.array([], dtype="S1")
        g = root.create_group("batch_norm")
        g.attrs["weight_names"] = [b"batch_norm/gamma:0"]
        g.create_dataset("batch_norm/gamma:0", data=gamma)
        if full_model:
            f.attrs["model_config"] = '{"class_name": "Sequential"}'
            f.attrs["keras_version"] = b"2.15.0"
            f.create_dataset("optimizer_weights/Adam/iter:0", data=np.int64(10))
    return {"dense/kernel": kernel, "dense/bias": bias, "batch_norm/gamma": gamma}


@pytest.mark.parametrize("full_model,split", [(True, False), (False, False), (False, True)])
def test_keras2_names(tmp_path, full_model, split):
    p = tmp_path / "model.h5"
    want = _keras2(p, full_model, split)
    with zipslice.load(p) as lsd:
        assert lsd.layout == "keras2"
        expected = list(want) + (["optimizer_weights/Adam/iter:0"] if full_model else [])
        assert list(lsd) == expected
        prefix = "model_weights/" if full_model else ""
        assert lsd.hdf5_paths["dense/kernel"] == f"{prefix}dense/dense/kernel:0"
        for name, a in want.items():
            assert _same(lsd.numpy(name), a)
        if full_model:
            assert lsd.metadata["model_config"] == '{"class_name": "Sequential"}'
            assert lsd.metadata["keras_version"] == "2.15.0"
    with HDF5Checkpoint(p, keras_names=False) as raw:
        assert raw.layout == "plain" and f"{prefix}dense/dense/kernel:0" in raw


def _keras3(path):
    """Keras 3 .weights.h5: layers/<name>/vars/<i>, optimizer/vars/<i>; bfloat16 as opaque + dtype attr."""
    arrays = {
        "layers/dense/vars/0": _array("float32", (4, 3), 1),
        "layers/dense/vars/1": _array("float32", (3,), 2),
        "layers/functional/layers/dense_1/vars/0": _array("float16", (2, 2), 3),
        "optimizer/vars/0": np.int64(4),
    }
    bf = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
        ds = f.create_dataset("layers/embedding/vars/0", data=bf)  # what Keras 3 does for bfloat16
        ds.attrs["dtype"] = "bfloat16"
        f.create_group("layers/dropout/vars")
    return arrays, bf


def test_keras3_names_and_bfloat16(tmp_path):
    p = tmp_path / "model.weights.h5"
    arrays, bf = _keras3(p)
    with zipslice.load(p) as lsd:
        assert lsd.layout == "keras3"
        assert set(lsd) == {"dense/vars/0", "dense/vars/1", "functional/layers/dense_1/vars/0",
                            "embedding/vars/0", "optimizer/vars/0"}
        for path, a in arrays.items():
            name = path.removeprefix("layers/")
            assert lsd.hdf5_paths[name] == path
            assert _same(lsd.numpy(name), np.asarray(a)), name
        assert lsd.info("embedding/vars/0").dtype == "bfloat16"
        assert lsd["embedding/vars/0"].tolist() == [1.5, -2.0, 3.25]
        assert lsd.numpy("embedding/vars/0", raw=True).tobytes() == bf.tobytes()


def test_keras3_collision_falls_back_to_paths(tmp_path):
    p = tmp_path / "clash.weights.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("layers/optimizer/vars/0", data=np.zeros(2))
        f.create_dataset("optimizer/vars/0", data=np.ones(2))
    with zipslice.load(p) as lsd:
        assert lsd.layout == "plain"
        assert sorted(lsd) == ["layers/optimizer/vars/0", "optimizer/vars/0"]


def test_bad_dtype_mark_is_corrupt(tmp_path):
    p = tmp_path / "bad.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("w", data=np.zeros(3, dtype="<f4")).attrs[DTYPE_ATTR] = "bfloat16"
    with pytest.raises(CorruptCheckpointError, match="marked as 'bfloat16'"):
        zipslice.load(p)


# -- writer --------------------------------------------------------------------------------------------

def _every_dtype_tensors():
    out = {}
    for i, d in enumerate(dtypes.BY_NAME.values()):
        a = _array(d.name, (2, 3), i)
        raw = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy())
        out[f"layer{i}/{d.name}"] = raw.view(dtypes.to_torch(d.name)).reshape(2, 3)
    out["scalar"] = torch.tensor(7, dtype=torch.int64)
    out["empty"] = torch.zeros(0, 5)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_writer_output_reads_back_in_h5py_bit_for_bit(tmp_path):
    tensors = _every_dtype_tensors()
    p = tmp_path / "out.h5"
    zipslice.save(p, tensors, metadata={"producer": "zipslice", "note": "ünïcode"})
    with h5py.File(p, "r") as f:
        assert dict(f.attrs) == {"producer": "zipslice", "note": "ünïcode"}
        for name, t in tensors.items():
            ds = f[name]
            assert ds.shape == tuple(t.shape), name
            assert ds.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
            marked = ds.attrs.get("dtype")  # Keras 3's convention for dtypes HDF5 lacks (bfloat16, float8)
            if marked is not None:
                assert marked == dtypes.from_torch(t.dtype).name
                assert ds.dtype.kind == "V" and ds.id.get_type().get_class() == h5py.h5t.OPAQUE
            else:
                assert ds.dtype == dtypes.from_torch(t.dtype).to_numpy(), name
            assert ds[()].tobytes() == _bits(t), name
    with zipslice.load(p) as lsd:
        assert list(lsd) == list(tensors), "the writer's order is kept (creation-order tracking)"
        for name, t in tensors.items():
            got = lsd[name]
            assert got.dtype == t.dtype and _bits(got) == _bits(t), name
            if t.numel():
                assert lsd.info(name).offset is not None, "written contiguous, read by positioned read"


def test_writer_ties_become_hard_links(tmp_path):
    w = torch.arange(6.0)
    p = tmp_path / "tied.h5"
    zipslice.save(p, {"embed/weight": w, "head/weight": w, "other": w.clone()})
    with h5py.File(p, "r") as f:
        assert f["embed/weight"].id == f["head/weight"].id
        assert f["other"].id != f["embed/weight"].id
    with zipslice.load(p) as lsd:
        assert lsd.info("head/weight").storage == "embed/weight"
        assert torch.equal(lsd["head/weight"], w)


def test_writer_refuses_names_hdf5_cannot_keep(tmp_path):
    p = tmp_path / "x.h5"
    for bad, msg in [({"a//b": np.zeros(1)}, "empty"), ({"/a": np.zeros(1)}, "empty"),
                     ({"a/../b": np.zeros(1)}, r"'\.\.'"), ({"a": np.zeros(1), "a/b": np.zeros(1)}, "both")]:
        with pytest.raises(ZipsliceError, match=msg):
            zipslice.save(p, bad)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    p = tmp_path / "x.h5"
    zipslice.save(p, {"a": np.arange(3.0)})
    before = p.read_bytes()

    def boom():
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        zipslice.save(p, [("a", np.zeros(2)), ("b", TensorSource("b", "float32", (2,), boom))])
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["x.h5"]


def test_safetensors_to_hdf5_and_back_is_lossless(tmp_path):
    tensors = {k: v for k, v in _every_dtype_tensors().items() if dtypes.from_torch(v.dtype).safetensors}
    st = tmp_path / "a.safetensors"
    safetensors.torch.save_file(tensors, str(st), metadata={"format": "pt"})
    h5 = tmp_path / "a.h5"
    with zipslice.load(st) as lsd:
        zipslice.save(h5, lsd)
    back = tmp_path / "b.safetensors"
    with zipslice.load(h5) as lsd:
        assert lsd.metadata == {"format": "pt"}
        zipslice.save(back, lsd)
    assert back.read_bytes() == st.read_bytes()


def test_enum_reads_as_its_integers_and_long_double_is_skipped(tmp_path):
    p = tmp_path / "odd.h5"
    colour = h5py.enum_dtype({"RED": 0, "GREEN": 1, "BLUE": 2}, basetype="i1")
    with h5py.File(p, "w") as f:
        f.create_dataset("e", data=np.array([0, 2, 1], dtype=colour))
        f.create_dataset("ld", data=np.array([1, 2], dtype=np.longdouble))
    with zipslice.load(p) as lsd:
        assert list(lsd) == ["e"] and lsd.numpy("e").tolist() == [0, 2, 1] and lsd.info("e").dtype == "int8"
        assert "no torch dtype" in lsd.skipped["ld"]


def test_string_metadata_named_like_keras_is_not_a_keras_file(tmp_path):
    p = tmp_path / "meta.h5"
    zipslice.save(p, {"w": np.arange(3.0)}, metadata={"layer_names": "w", "weight_names": "x"})
    with zipslice.load(p) as lsd:
        assert lsd.layout == "plain" and list(lsd) == ["w"]
        assert lsd.metadata == {"layer_names": "w", "weight_names": "x"}


from hypothesis import given, settings, strategies as st  # noqa: E402

_NAME = st.lists(st.from_regex(r"[A-Za-z0-9_.:-]{1,6}", fullmatch=True).filter(lambda s: s not in (".", "..")),
                 min_size=1, max_size=3).map("/".join)


@settings(max_examples=15, deadline=None)
@given(st.dictionaries(_NAME, st.tuples(st.sampled_from(sorted(dtypes.BY_NAME)),
                                        st.lists(st.integers(0, 3), max_size=3)), max_size=5))
def test_property_writer_round_trips_through_h5py(tmp_path_factory, specs):
    names = sorted(specs)
    # drop names that would need another name to be a group
    names = [n for n in names if not any(m != n and m.startswith(n + "/") for m in names)]
    tensors = {}
    for i, n in enumerate(names):
        d, shape = specs[n]
        if 0 in shape:
            tensors[n] = torch.empty(tuple(shape), dtype=dtypes.to_torch(d))
            continue
        raw = torch.from_numpy(np.ascontiguousarray(_array(d, tuple(shape), i)).reshape(-1).view(np.uint8).copy())
        tensors[n] = raw.view(dtypes.to_torch(d)).reshape(tuple(shape))
    p = tmp_path_factory.mktemp("h5") / "p.h5"
    zipslice.save(p, tensors)
    with h5py.File(p, "r") as f:
        for n, t in tensors.items():
            assert f[n].shape == tuple(t.shape) and f[n][()].tobytes() == _bits(t), n
    with zipslice.load(p) as lsd:
        assert list(lsd) == list(tensors)
        for n, t in tensors.items():
            assert lsd[n].dtype == t.dtype and _bits(lsd[n]) == _bits(t), n


def test_damaged_object_header_is_corrupt_naming_the_dataset(tmp_path):
    p = tmp_path / "damaged.h5"
    zipslice.save(p, {"good": np.arange(4.0), "bad/w": np.arange(6.0)})
    with h5py.File(p, "r") as f:
        addr = h5py.h5o.get_info(f["bad/w"].id).addr  # where the dataset's object header starts
    blob = bytearray(p.read_bytes())
    blob[addr + 4: addr + 20] = b"\xff" * 16
    p.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match="damaged") as exc:
        zipslice.load(p)
    assert exc.value.entry == "bad/w"


def test_bfloat16_follows_keras3_convention(tmp_path):
    """bfloat16 / float8 are written as Keras 3 writes bfloat16: opaque data with attribute dtype=<name>,
    so Keras 3's reading (np.array(dset, dtype=ml_dtypes.bfloat16)) gives the values; h5py never shows them
    as plausible uint16 numbers."""
    bf = torch.tensor([1.5, -2.25, 3.0, float("inf")], dtype=torch.bfloat16)
    f8 = torch.tensor([0.5, -1.0], dtype=torch.float8_e4m3fn)
    zipslice.save(tmp_path / "k.h5", {"w": bf, "q": f8})
    with h5py.File(tmp_path / "k.h5", "r") as f:
        assert f["w"].attrs["dtype"] == "bfloat16" and f["w"].dtype == np.dtype("V2")
        as_keras = np.array(f["w"], dtype=ml_dtypes.bfloat16)  # what Keras 3's H5IOStore does
        assert as_keras.view(np.uint16).tobytes() == _bits(bf)
        assert f["q"].attrs["dtype"] == "float8_e4m3fn" and f["q"].dtype == np.dtype("V1")
    with zipslice.load(tmp_path / "k.h5") as lsd:
        assert lsd["w"].dtype == torch.bfloat16 and _bits(lsd["w"]) == _bits(bf)
        assert lsd["q"].dtype == torch.float8_e4m3fn and _bits(lsd["q"]) == _bits(f8)
        assert lsd.info("w").offset is not None  # still one positioned read


def test_files_marked_the_old_way_still_read(tmp_path):
    bits = torch.tensor([1.0, -2.0], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    with h5py.File(tmp_path / "old.h5", "w") as f:
        f.create_dataset("w", data=bits).attrs[DTYPE_ATTR] = "bfloat16"
    with zipslice.load(tmp_path / "old.h5") as lsd:
        assert lsd["w"].tolist() == [1.0, -2.0] and lsd["w"].dtype == torch.bfloat16
