"""zipslice.frames: any tensor as a stream of frames, and the writers taking tensors frame by frame.

The cgroup tests convert (with --dtype float32), show and diff a tensor several times the memory limit of the
cgroup every process runs in (page cache included), then read the output back with the format's own library
and compare it bit for bit with torch's cast of the source.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.numpy import save_file
from safetensors.torch import load_file

import zipslice
from zipslice import frames, pagecache
from zipslice.convert import convert
from zipslice.errors import ZipsliceError
from zipslice.fileio import atomic_output
from zipslice.info import TensorSource

from support.limits import run_limited

ROOT = Path(__file__).resolve().parents[2]


# -- frames of any layout ----------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.data())
def test_flat_boxes_tile_the_range_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    ids = np.arange(n).reshape(shape)
    boxes = frames.flat_boxes(tuple(shape), start, stop)
    got = [ids[b.numpy_index()].reshape(-1) for b in boxes]
    assert np.array_equal(np.concatenate(got) if got else np.empty(0, int), np.arange(start, stop))
    assert len(boxes) <= 2 * len(shape) + 1


def _ids(shape, dtype=torch.float32):
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape).to(dtype)


def _layouts(tmp: Path):
    """One file per way of holding a tensor's bytes; each maps a name to the tensor it must read back as."""
    x = _ids((37, 11, 5))
    torch.save({"t": x.transpose(0, 2), "c": x}, tmp / "strided.pt")  # a strided view of one storage
    save_file({"t": x.numpy()}, str(tmp / "plain.safetensors"))
    with h5py.File(tmp / "chunked.h5", "w") as f:
        f.create_dataset("t", data=x.numpy(), chunks=(4, 3, 5), compression="gzip")
    return {"strided.pt": {"t": x.transpose(0, 2), "c": x}, "plain.safetensors": {"t": x},
            "chunked.h5": {"t": x}}


@pytest.mark.parametrize("elements", [1, 7, 55, 1 << 20])
def test_frames_of_every_layout_are_the_values_in_order(tmp_path, elements):
    for name, tensors in _layouts(tmp_path).items():
        with zipslice.load(tmp_path / name) as lsd:
            for key, want in tensors.items():
                got = list(frames.iter_frames(lsd, key, elements))
                assert all(f.size <= elements for f in got)
                flat = np.concatenate(got).view(np.float32)
                assert np.array_equal(flat, want.contiguous().reshape(-1).numpy()), (name, key)


def test_a_chunked_dataset_is_read_a_frame_at_a_time(tmp_path, monkeypatch):
    """A chunked HDF5 dataset (no offset) is read box by box through h5py, never whole."""
    _layouts(tmp_path)
    with zipslice.load(tmp_path / "chunked.h5") as lsd:
        monkeypatch.setattr(type(lsd), "_read_span", lambda *a: pytest.fail("read whole"))
        assert sum(f.size for f in frames.iter_frames(lsd, "t", 100)) == 37 * 11 * 5


def test_whole_elements_regroups_pieces_cut_inside_elements():
    data = np.arange(50, dtype="<u4").view(np.uint8)
    cuts = [0, 3, 4, 9, 10, 101, 200]
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:])]
    out = list(frames.whole_elements(pieces, 4))
    assert all(p.nbytes % 4 == 0 for p in out)
    assert b"".join(bytes(p) for p in out) == data.tobytes()
    with pytest.raises(ValueError, match="2 bytes into an element"):
        list(frames.whole_elements([data[:6]], 4))


# -- writers take frames -----------------------------------------------------------------------------------
def _framed(name: str, arr: np.ndarray, cut: int) -> TensorSource:
    """A source whose read() must not be called: the writer takes its bytes in pieces of ``cut`` bytes."""
    raw = arr.reshape(-1).view(np.uint8)

    def read():
        raise AssertionError("the writer read the whole tensor")
    return TensorSource(name=name, dtype="float32", shape=arr.shape, read=read,
                        chunks=lambda: (raw[i:i + cut] for i in range(0, raw.size, cut)))


@pytest.mark.parametrize("fmt,ext", [("torch", "pt"), ("safetensors", "safetensors"), ("hdf5", "h5")])
def test_every_writer_takes_a_tensor_piece_by_piece(tmp_path, fmt, ext):
    a = np.random.default_rng(0).standard_normal((13, 7, 3)).astype(np.float32)
    dst = tmp_path / f"out.{ext}"
    zipslice.formats.get(fmt).writer_function()(dst, [_framed("w", a, 37)])  # pieces cut inside elements
    with zipslice.load(dst) as lsd:
        assert np.array_equal(lsd.numpy("w"), a)
    if fmt == "torch":
        assert torch.equal(torch.load(dst, weights_only=True)["w"], torch.from_numpy(a))


@pytest.mark.parametrize("fmt,ext", [("torch", "pt"), ("safetensors", "safetensors"), ("hdf5", "h5")])
def test_a_source_giving_the_wrong_number_of_bytes_is_named(tmp_path, fmt, ext):
    a = np.zeros(10, np.float32)
    src = _framed("w", a, 16)
    short = TensorSource(name="w", dtype="float32", shape=(11,), read=src.read, chunks=src.chunks)
    with pytest.raises(ZipsliceError, match=r"\[w\].*(40|bytes)"):
        zipslice.formats.get(fmt).writer_function()(tmp_path / f"o.{ext}", [short])
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing published, no temp file left


def test_convert_casts_frame_by_frame_bit_for_bit(tmp_path):
    """A cast in frames equals torch's cast of the whole tensor (bfloat16 -> float32, -> float16, float32 ->
    bfloat16 with values that round, overflow and NaN)."""
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal(3 * (1 << 20) + 5).astype(np.float32) * 1e3)
    x[:4] = torch.tensor([float("inf"), float("nan"), 7e4, -3.4e38])
    torch.save({"x": x, "b": x.to(torch.bfloat16)}, tmp_path / "s.pt")
    for dtype, tdt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        out = tmp_path / f"o-{dtype}.safetensors"
        convert(tmp_path / "s.pt", out, dtype=dtype)
        got = load_file(out)
        for k in ("x", "b"):
            want = torch.load(tmp_path / "s.pt", weights_only=True)[k].to(tdt)
            same = got[k].view(torch.int16 if tdt != torch.float32 else torch.int32) == \
                want.view(torch.int16 if tdt != torch.float32 else torch.int32)
            assert bool(same.all()) or bool((same | torch.isnan(want.float())).all()), (dtype, k)


# -- write-behind ------------------------------------------------------------------------------------------
def _resident(path, nbytes: int) -> float:
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        n = nbytes // page
        vec = (ctypes.c_ubyte * n)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n * page), vec) == 0
        return sum(v & 1 for v in vec) / n


def test_written_pages_are_let_go_of_once_on_disk(tmp_path):
    window = 1 << 20
    path = tmp_path / "w.bin"
    with open(path, "wb") as f:
        wb = pagecache.WriteBehind(f.fileno(), window=window, let_go=True)
        block = os.urandom(window // 4)
        for i in range(64):
            f.write(block)
            f.flush()
            wb.wrote((i + 1) * len(block))
        assert wb.settled >= 16 * window - 2 * window
    if _resident(path, 8 * window) > 0.5:
        pytest.skip(f"the file system under {tmp_path} keeps pages after POSIX_FADV_DONTNEED")
    assert _resident(path, 12 * window) == 0.0
    assert path.read_bytes() == block * 64


def test_atomic_output_writes_big_buffers_in_windows(tmp_path, monkeypatch):
    seen = []
    real = pagecache.WriteBehind.wrote
    monkeypatch.setattr(pagecache.WriteBehind, "wrote", lambda self, end: (seen.append(end), real(self, end)))
    data = os.urandom(5 * pagecache.WRITE_WINDOW + 123)
    with atomic_output(tmp_path / "o.bin") as f:
        f.write(data[:100])
        f.write(data[100:])  # one write of 5 windows: handed to the kernel a window at a time
        f.seek(3)
        f.write(b"xyz")
        assert f.tell() == 6
    assert len(seen) == 5 and all(b - a == pagecache.WRITE_WINDOW for a, b in zip(seen, seen[1:]))
    assert (tmp_path / "o.bin").read_bytes() == data[:3] + b"xyz" + data[6:]


# -- inside a memory cgroup: tensors several times the limit -------------------------------------------------
LIMIT = 128 << 20
ROWS, COLS = 16384, 4096  # 64 Mi elements: 128 MiB of bfloat16, 256 MiB of float32


def _zipslice(tmp: Path, *args: str, memory: int = LIMIT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = run_limited([sys.executable, "-c", "from zipslice.cli import main; main()", *args], cwd=tmp, env=env,
                      timeout=300, memory=memory)
    if not res.capped:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller): ran nothing")
    assert res.returncode == 0 and not res.oom_killed, (args, res.returncode, res.err[-2000:])
    return res


def _bits(n: int) -> np.ndarray:
    """n bfloat16 values spread over signs and exponents (never NaN or inf), made without a random draw."""
    k = np.arange(n, dtype=np.uint32)
    k *= np.uint32(2654435761)  # Knuth's multiplicative hash: every bit pattern comes up
    return ((k >> np.uint32(16)).astype(np.uint16) & np.uint16(0xBF7F)).view(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("big")
    save_file({"embed": _bits(ROWS * COLS).reshape(ROWS, COLS), "norm": np.ones(COLS, ml_dtypes.bfloat16)},
              str(tmp / "m.safetensors"))
    return tmp


def _same_as_torch_cast(got: torch.Tensor, src: torch.Tensor) -> bool:
    step = 1024
    return all(torch.equal(got[r:r + step].view(torch.int32), src[r:r + step].float().view(torch.int32))
               for r in range(0, src.shape[0], step))


def _convert_in_cgroup(big: Path, ext: str) -> None:
    out = big / f"f32.{ext}"
    res = _zipslice(big, "convert", "m.safetensors", out.name, "--dtype", "float32", "-q")
    src = load_file(big / "m.safetensors")
    if ext == "pt":
        got = torch.load(out, weights_only=True, mmap=True)
    elif ext == "safetensors":
        got = load_file(out)
    else:
        with h5py.File(out) as f:
            got = {k: torch.from_numpy(f[k][()]) for k in f}
    assert set(got) == set(src) and got["embed"].dtype == torch.float32
    assert all(_same_as_torch_cast(got[k], src[k]) for k in src)
    assert res.peak_bytes <= LIMIT


def test_convert_to_float32_fits_a_cgroup_smaller_than_the_tensor(big):
    """128 MiB of bfloat16 cast to 256 MiB of float32 (a torch zip) by a process in a 128 MiB cgroup."""
    _convert_in_cgroup(big, "pt")


@pytest.mark.slow
@pytest.mark.parametrize("ext", ["safetensors", "h5"])
def test_convert_to_float32_in_a_small_cgroup_for_every_writer(big, ext):
    _convert_in_cgroup(big, ext)
    (big / f"f32.{ext}").unlink()


def test_show_and_diff_fit_a_cgroup_smaller_than_the_tensor(big):
    if not (big / "f32.pt").exists():
        _zipslice(big, "convert", "m.safetensors", "f32.pt", "--dtype", "float32", "-q")
    show = json.loads(_zipslice(big, "show", "f32.pt", "embed", "--json").stdout)
    src = load_file(big / "m.safetensors")["embed"]
    assert show["stats"]["count"] == ROWS * COLS and show["stats"]["max"] == src.float().max().item()
    changed = src.clone()
    changed[5, 7] = 3.0
    changed[-1, -1] = -1.0
    torch.save({"embed": changed, "norm": torch.ones(COLS, dtype=torch.bfloat16)}, big / "m2.pt")
    del src, changed
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = run_limited([sys.executable, "-c", "from zipslice.cli import main; main()", "diff", "m.safetensors",
                       "m2.pt", "--json"], cwd=big, env=env, timeout=300, memory=LIMIT)
    assert res.returncode == 1 and not res.oom_killed, res.err[-2000:]  # 1: they differ
    report = {t["name"]: t for t in json.loads(res.stdout)["tensors"]}
    assert report["embed"]["n_changed"] == 2 and report["norm"]["status"] == "same"


@pytest.mark.slow
def test_a_float32_output_over_4_gib_is_a_zip64_file_torch_reads(tmp_path):
    """The Llama-3-8B embedding and head (128256 x 4096 bfloat16: 1.05 GB each) and a third such tensor: cast to
    float32 they make a 6.3 GB torch file (zip64: its offsets pass 4 GiB), written by a process in a 1 GiB
    cgroup and read back by torch.load(mmap=True), bit for bit torch's cast of each tensor."""
    rows, cols = 128256, 4096
    from safetensors import safe_open

    src = tmp_path / "big.safetensors"
    names = ("lm_head.weight", "model.embed_tokens.weight", "model.extra.weight")
    # written by zipslice's own writer from sources that generate each tensor frame by frame (no 1 GB array)
    step = rows // 16

    def source(i):
        def chunks():
            for r in range(0, rows, step):
                n = min(step, rows - r) * cols
                yield memoryview(_bits(n).view(np.uint16) ^ np.uint16(i)).cast("B")
        return TensorSource(name=names[i], dtype="bfloat16", shape=(rows, cols), read=None, chunks=chunks)
    zipslice.formats.get("safetensors").writer_function()(src, [source(i) for i in range(3)])
    out = tmp_path / "f32.pt"
    _zipslice(tmp_path, "convert", src.name, out.name, "--dtype", "float32", "-q", memory=1 << 30)
    assert out.stat().st_size > 4 << 30  # zip64
    got = torch.load(out, weights_only=True, mmap=True)
    with safe_open(str(src), "pt") as f:
        for name in names:
            s = f.get_slice(name)
            for r in range(0, rows, 4096):
                assert torch.equal(got[name][r:r + 4096].view(torch.int32), s[r:r + 4096].float().view(torch.int32))


def test_a_source_given_new_bytes_forgets_the_old_chunks_and_crc():
    """read, crc32 and chunks describe one tensor's bytes: new bytes replace all three (a writer that prefers
    chunks would otherwise write the old values)."""
    old = np.arange(8, dtype="<f4")
    src = TensorSource("w", "float32", (8,), lambda: old.tobytes(), crc32=lambda: 123,
                       chunks=lambda: iter([old[:4].tobytes(), old[4:].tobytes()]))
    new = src.with_bytes(lambda: (old * 2).tobytes())
    assert new.chunks is None and new.crc32 is None
    assert b"".join(bytes(p) for p in new.pieces()) == (old * 2).tobytes()
    assert b"".join(bytes(p) for p in src.pieces()) == old.tobytes()  # the original is unchanged
