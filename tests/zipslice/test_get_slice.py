"""lsd.get_slice(key)[index]: equal to numpy slicing of the whole tensor for every dtype and format, and it
reads only the bytes the slice needs (counted by the kernel: /proc/self/io rchar) and holds little memory.

Files are written by the formats' own libraries (torch.save, safetensors, h5py) wherever they can write
the dtype; zipslice's writers only for what those cannot (bfloat16 / float8 in HDF5).
"""
from __future__ import annotations

import math
import tracemalloc

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import zipslice
from zipslice import dtypes
from zipslice.slicing import parse_index, select

INDICES = [(), np.s_[0], np.s_[-1], np.s_[1:3], np.s_[::2], np.s_[:, 1], np.s_[..., 2], np.s_[1, ..., 1:6:2],
           np.s_[:, 2:5, ::3], np.s_[2, 3, 4], np.s_[5:100], np.s_[3:1], np.s_[:, :, -2:]]
SHAPE = (4, 5, 7)
TORCH_DTYPES = [d for d in dtypes.BY_NAME if hasattr(torch, d)]


def _tensor(name: str, seed: int) -> torch.Tensor:
    """Random bits of every dtype (NaN payloads included): equality below is bit equality."""
    dt = dtypes.get(name)
    g = np.random.default_rng(seed)
    n = math.prod(SHAPE)
    if name == "bool":
        return torch.from_numpy(g.integers(0, 2, n).astype(bool)).reshape(SHAPE)
    raw = torch.from_numpy(g.integers(0, 256, n * dt.itemsize, dtype=np.uint8))
    return raw.view(dtypes.to_torch(name)).reshape(SHAPE)


def _bits(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr).tobytes()


def _write(fmt: str, path, tensors: dict[str, torch.Tensor]) -> None:
    if fmt == "torch":
        torch.save(tensors, path)
    elif fmt == "torch-legacy":
        torch.save(tensors, path, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        save_file(tensors, path)
    elif fmt in ("hdf5", "hdf5-chunked"):
        with h5py.File(path, "w") as f:
            for k, t in tensors.items():
                dt = dtypes.from_torch(t.dtype)
                raw = t.contiguous().view(torch.uint8).numpy() if dt.numpy and not dt.numpy.startswith("ml:") \
                    else None
                if raw is None:  # bfloat16 / float8: h5py cannot name them; Keras 3's convention
                    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().view(f"V{dt.itemsize}").reshape(SHAPE)
                else:
                    data = raw.view(dt.to_numpy()).reshape(SHAPE)
                chunks = (2, 3, 4) if fmt == "hdf5-chunked" else None
                ds = f.create_dataset(k, data=data, chunks=chunks, compression="gzip" if chunks else None)
                if raw is None:
                    ds.attrs["dtype"] = dt.name
    elif fmt == "sharded":
        zipslice.save(path, list(tensors.items()), max_shard_bytes=400)
    else:
        raise AssertionError(fmt)


FORMATS = {"torch": "m.pt", "torch-legacy": "m.pt", "safetensors": "m.safetensors", "hdf5": "m.h5",
           "hdf5-chunked": "m.h5", "sharded": "m.safetensors.index.json"}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_dtype_equals_numpy_slicing(tmp_path, fmt):
    names = [d for d in TORCH_DTYPES if not (fmt in ("safetensors", "sharded") and dtypes.get(d).safetensors is None)]
    tensors = {d: _tensor(d, i) for i, d in enumerate(names)}
    if fmt.startswith("torch"):  # strided views of one storage: a transposed and an offset view
        base = _tensor("float32", 99)
        tensors["t_view"] = base.permute(2, 0, 1)
        tensors["offset_view"] = base[1:, ::2, 3]
    path = tmp_path / FORMATS[fmt]
    _write(fmt, path, tensors)
    with zipslice.load(path) as lsd:
        for name in tensors:
            whole = lsd.numpy(name, raw=True)
            assert _bits(whole) == _bits(tensors[name].contiguous().view(torch.uint8).numpy()), name
            sl = lsd.get_slice(name, framework="np")
            assert sl.get_shape() == list(tensors[name].shape)
            for index in INDICES:
                if len([i for i in (index if isinstance(index, tuple) else (index,)) if i is not Ellipsis]) \
                        > whole.ndim:
                    continue
                want = whole[index]
                got = sl.raw(index)
                assert got.shape == np.shape(want) and _bits(got) == _bits(want), (name, index)
            dt = dtypes.get(lsd.info(name).dtype)
            if dt.numpy is not None:  # the typed result, too
                typed = sl[1:3]
                assert typed.dtype == dt.to_numpy() and _bits(typed) == _bits(whole[1:3])
        pt = lsd.get_slice(list(tensors)[0])[..., 1]  # framework="pt": a torch tensor like lsd[key]
        assert isinstance(pt, torch.Tensor) and torch.equal(pt, lsd[list(tensors)[0]][..., 1])


def _rchar() -> tuple[int, int]:
    """(bytes this process has read through read(2)-like calls, preadv included, as the kernel counts them;
    bytes of this very read of /proc/self/io, which the next count will include)."""
    with open("/proc/self/io", "rb", buffering=0) as f:
        text = f.read(4096)
    counters = dict(line.split(b": ") for line in text.splitlines())
    return int(counters[b"rchar"]), len(text)


def _prepare(lsd, name: str) -> None:
    """What a first read does once besides reading data, done before measuring: resolve the offset (a torch
    zip local header) and decide the page-cache policy (reads /proc/meminfo and the cgroup's limits)."""
    lsd.info(name)
    lsd.dropping_behind()


def _bytes_read(fn):
    before, own = _rchar()
    out = fn()
    after, _ = _rchar()
    return out, after - before - own


ROWS, COLS = 2048, 512  # float32: 4 MiB


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    w = torch.randn(ROWS, COLS)
    torch.save({"emb": w, "emb_t": w.t()}, d / "m.pt")
    save_file({"emb": w}, d / "m.safetensors")
    with h5py.File(d / "m.h5", "w") as f:
        f.create_dataset("emb", data=w.numpy())
        f.create_dataset("chunked", data=w.numpy(), chunks=(16, COLS))
    return d, w.numpy()


@pytest.mark.parametrize("file", ["m.pt", "m.safetensors", "m.h5"])
def test_rows_read_exactly_their_bytes(big, file):
    d, w = big
    with zipslice.load(d / file) as lsd:
        sl = lsd.get_slice("emb", framework="np")
        _prepare(lsd, "emb")
        got, n = _bytes_read(lambda: sl[10:20])
        assert np.array_equal(got, w[10:20])
        assert n == 10 * COLS * 4, f"read {n} bytes for 10 rows of {COLS * 4}"
        got, n = _bytes_read(lambda: sl[7])
        assert np.array_equal(got, w[7]) and n == COLS * 4


@pytest.mark.parametrize("file", ["m.pt", "m.safetensors", "m.h5"])
def test_columns_read_only_their_bytes(big, file):
    d, w = big
    with zipslice.load(d / file) as lsd:
        _prepare(lsd, "emb")
        sl = lsd.get_slice("emb", framework="np")
        got, n = _bytes_read(lambda: sl[:100, 3:5])
        assert np.array_equal(got, w[:100, 3:5])
        assert n == 100 * 2 * 4  # one 8-byte read per row: the rows between are skipped
        got, n = _bytes_read(lambda: sl[:10, ::2])
        assert np.array_equal(got, w[:10, ::2])
        # every other element: gaps as short as the runs, so each row is read whole (at most 2x the need)
        assert n == (9 * COLS + COLS - 1) * 4 <= 2 * got.nbytes


def test_merged_reads_are_bounded(big, monkeypatch):
    """A slice spread over the whole tensor is read in pieces of at most MAX_READ bytes."""
    from zipslice import slicing

    d, w = big
    monkeypatch.setattr(slicing, "MAX_READ", 64 * 1024)
    with zipslice.load(d / "m.safetensors") as lsd:
        _prepare(lsd, "emb")
        sl = lsd.get_slice("emb", framework="np")
        tracemalloc.start()
        try:
            got, n = _bytes_read(lambda: sl[:, ::2])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(got, w[:, ::2])
        assert n <= 2 * got.nbytes
        # the result, one read, one batch of gather indices (int64) and of gathered values
        assert peak < got.nbytes + slicing.MAX_READ + slicing._GATHER_ELEMENTS * (8 + 4) + 64 * 1024, peak


def test_transposed_view_reads_only_what_it_needs(big):
    d, w = big
    with zipslice.load(d / "m.pt") as lsd:
        _prepare(lsd, "emb_t")
        sl = lsd.get_slice("emb_t", framework="np")
        got, n = _bytes_read(lambda: sl[:, 5:7])  # columns of the transpose = two rows of the storage
        assert np.array_equal(got, w.T[:, 5:7])
        assert n == 2 * COLS * 4


def test_chunked_hdf5_reads_only_the_chunks_it_touches(big):
    d, w = big
    with zipslice.load(d / "m.h5") as lsd:
        assert lsd.info("chunked").offset is None
        sl = lsd.get_slice("chunked", framework="np")
        sl[0:1]  # HDF5 reads its chunk index on first use; measure a slice after that
        got, n = _bytes_read(lambda: sl[32:48])
        assert np.array_equal(got, w[32:48])
        assert 16 * COLS * 4 <= n <= 16 * COLS * 4 + 64 * 1024, n  # one chunk, plus HDF5's own small reads
        assert n < ROWS * COLS * 4 / 50


def test_memory_is_the_slice_not_the_tensor(big):
    d, w = big
    with zipslice.load(d / "m.safetensors") as lsd:
        sl = lsd.get_slice("emb", framework="np")
        tracemalloc.start()
        try:
            got = sl[100:110]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(got, w[100:110])
        assert peak < 2 * got.nbytes + 64 * 1024, f"peak {peak} bytes for a {got.nbytes}-byte slice of 4 MiB"


@pytest.mark.parametrize("index, message", [
    (np.s_[None], "only integers, slices and '...'"), (np.s_[[0, 1]], "only integers"),
    (np.s_[::-1], "step must be positive"), (np.s_[4], "out of bounds"), (np.s_[-5], "out of bounds"),
    (np.s_[0, 0, 0, 0], "too many indices"), (np.s_[..., ...], "single ellipsis"), (np.s_[1.5], "only integers"),
])
def test_bad_indices_are_index_errors(tmp_path, index, message):
    save_file({"w": torch.zeros(SHAPE)}, tmp_path / "w.safetensors")
    with zipslice.load(tmp_path / "w.safetensors") as lsd, pytest.raises(IndexError, match=message):
        lsd.get_slice("w")[index]


def test_safetensors_style_accessors(tmp_path):
    save_file({"w": torch.zeros(3, 2, dtype=torch.bfloat16)}, tmp_path / "w.safetensors")
    with zipslice.load(tmp_path / "w.safetensors") as lsd:
        sl = lsd.get_slice("w")
        assert sl.get_shape() == [3, 2] and sl.get_dtype() == "BF16" and sl.dtype == "bfloat16" and len(sl) == 3
        with pytest.raises(ValueError, match="framework"):
            lsd.get_slice("w", framework="tf")
        with pytest.raises(KeyError, match="no tensor named 'x'"):
            lsd.get_slice("x")


def test_parse_index_reads_only_numbers():
    assert parse_index("0:10") == (slice(0, 10),)
    assert parse_index("[0:10, ::2]") == (slice(0, 10), slice(None, None, 2))
    assert parse_index("..., -1") == (Ellipsis, -1)
    assert select((5, 6), parse_index("1:3, 2")).shape == (2,)
    for bad in ("__import__('os')", "1:2:3:4", "a:b", ""):
        with pytest.raises(ValueError, match="is not an index"):
            parse_index(bad)
