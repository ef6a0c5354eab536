"""The shared pieces every format uses: dtype table, strided restriding, atomic output."""
import numpy as np
import pytest

from zipslice import dtypes
from zipslice.base import restride
from zipslice.fileio import atomic_output, pread_exact
from zipslice.errors import CorruptCheckpointError
from zipslice.info import TensorInfo, span_elements


def _info(shape, stride, dtype="float32", offset=0, byteorder="little"):
    n = span_elements(shape, stride)
    return TensorInfo(name="t", dtype=dtype, shape=shape, stride=stride, storage="s", storage_offset=0,
                      offset=offset, span_nbytes=n * dtypes.get(dtype).itemsize, file="f", byteorder=byteorder)


def test_span_of_strided_view_with_gaps():
    big = np.arange(24, dtype="<f4").reshape(4, 6)
    view = big[:, 2:4]
    info = _info((4, 2), (6, 1))
    span = big.reshape(-1)[2: 2 + span_elements((4, 2), (6, 1))].tobytes()
    assert span_elements((4, 2), (6, 1)) == 1 + 3 * 6 + 1
    got = restride(span, info).view("<f4")
    assert np.array_equal(got, view)


def test_transposed_and_expanded_views():
    a = np.arange(6, dtype="<i8").reshape(2, 3)
    got = restride(a.tobytes(), _info((3, 2), (1, 3), "int64")).view("<i8")
    assert np.array_equal(got, a.T)
    row = np.arange(3, dtype="<i8")
    got = restride(row.tobytes(), _info((4, 3), (0, 1), "int64")).view("<i8")
    assert np.array_equal(got, np.broadcast_to(row, (4, 3)))


def test_big_endian_is_swapped():
    a = np.array([1.5, -2.25, 3.0], dtype=">f8")
    got = restride(a.tobytes(), _info((3,), (1,), "float64", byteorder="big")).view("<f8")
    assert got.tolist() == [1.5, -2.25, 3.0]
    c = np.array([1 + 2j, -3.5j], dtype=">c16")
    got = restride(c.tobytes(), _info((2,), (1,), "complex128", byteorder="big")).view("<c16")
    assert got.tolist() == [1 + 2j, -3.5j]


def test_every_dtype_has_numpy_and_width():
    for d in dtypes.BY_NAME.values():
        assert d.to_numpy().itemsize == d.itemsize, d.name
        assert d.carrier.itemsize == d.itemsize


def test_pread_exact_refuses_past_end(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    import os
    fd = os.open(p, os.O_RDONLY)
    try:
        assert bytes(pread_exact(fd, 2, 1, str(p))) == b"bc"
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            pread_exact(fd, 3, 1, str(p), "entry")
    finally:
        os.close(fd)


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(dest) as f:
            f.write(b"half")
            raise RuntimeError("interrupted")
    assert dest.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with atomic_output(dest) as f:
        f.write(b"new")
    assert dest.read_bytes() == b"new"


def test_atomic_output_publishes_with_the_usual_mode(tmp_path):
    import os
    dest = tmp_path / "m.bin"
    old = os.umask(0o022)
    try:
        with atomic_output(dest) as f:
            f.write(b"x")
    finally:
        os.umask(old)
    assert dest.stat().st_mode & 0o777 == 0o644
