"""tempo.bits: 1-bit packing of boolean masks (numpy path on CPU, torch path elsewhere: both checked here)."""
import pytest

torch = pytest.importorskip("torch")

from tempo import bits  # noqa: E402


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (9,), (3, 5, 17), (1000,)])
@pytest.mark.parametrize("use_numpy", [True, False])
def test_round_trip(shape, use_numpy):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    mask = torch.rand(shape, generator=g) < 0.3
    packed = bits.pack(mask, use_numpy=use_numpy)
    assert packed.dtype == torch.uint8 and packed.numel() == bits.packed_size(mask.numel())
    assert torch.equal(bits.unpack(packed, shape, use_numpy=use_numpy), mask)
    assert torch.equal(bits.unpack_float(packed, mask.numel()), mask.reshape(-1).float())


def test_numpy_and_torch_paths_write_the_same_bytes():
    mask = torch.rand(4099, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(bits.pack(mask, use_numpy=True), bits.pack(mask, use_numpy=False))


def test_little_endian_bit_order():
    mask = torch.tensor([True, False, False, False, False, False, False, False, False, True])
    assert bits.pack(mask).tolist() == [1, 2]


def test_non_contiguous_mask_packs_in_logical_order():
    mask = torch.rand(6, 10, generator=torch.Generator().manual_seed(1)) < 0.5
    assert torch.equal(bits.unpack(bits.pack(mask.t()), (10, 6)), mask.t().contiguous())


def test_unpack_float_in_16_bit():
    mask = torch.tensor([True, False, True])
    out = bits.unpack_float(bits.pack(mask), 3, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("use_numpy", [True, False])
@pytest.mark.parametrize("numel", [1, 8, 13, 1000])
def test_unpack_float_paths_and_out_buffer(use_numpy, numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = bits.pack(mask)
    assert torch.equal(bits.unpack_float(packed, numel, use_numpy=use_numpy), mask.float())
    out = torch.full((bits.packed_size(numel) * 8,), 7.0, dtype=torch.float64)
    result = bits.unpack_float(packed, numel, torch.float64, out=out, use_numpy=use_numpy)
    assert result.data_ptr() == out.data_ptr() and torch.equal(result, mask.double())


def test_rejects_wrong_inputs():
    with pytest.raises(TypeError, match="bool"):
        bits.pack(torch.zeros(3))
    with pytest.raises(ValueError, match="cannot hold"):
        bits.unpack(torch.zeros(1, dtype=torch.uint8), (9,))
    with pytest.raises(TypeError, match="uint8"):
        bits.unpack(torch.zeros(2, dtype=torch.int32), (9,))
