"""Round trips through the public API: torch.save -> zipslice.load -> zipslice.save -> torch.load."""
import math
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as hs

import zipslice
from zipslice import dtypes

DTYPES = list(dtypes.BY_NAME)


def assert_same(got, want, path="root"):
    """Same types, same containers in the same order, tensors equal bit for bit with the same kind."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.requires_grad == want.requires_grad, path
        g = got.detach().contiguous().reshape(-1).view(torch.uint8)
        w = want.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(g, w), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), path
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    else:
        assert got == want, path


def through_zipslice(obj, tmp: Path, fmt_kw=None):
    torch.save(obj, tmp / "orig.pt")
    with zipslice.load(tmp / "orig.pt") as lsd:
        zipslice.save(tmp / "copy.pt", lsd, **(fmt_kw or {}))
    return [torch.load(tmp / "copy.pt", weights_only=True),
            torch.load(tmp / "copy.pt", weights_only=True, mmap=True)]


def test_typical_state_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 20))
    model[2].weight = model[0].weight  # tied output embedding
    model.register_buffer("steps", torch.tensor(5))
    sd = model.state_dict(keep_vars=True)
    for got in through_zipslice({"model": sd, "epoch": 2}, tmp_path):
        assert_same(got, {"model": sd, "epoch": 2})
        m = got["model"]
        assert m["2.weight"].untyped_storage().data_ptr() == m["0.weight"].untyped_storage().data_ptr()
        assert isinstance(m["0.weight"], torch.nn.Parameter)


def test_views_keep_values(tmp_path):
    """Views of one storage (transpose, slice) come back with equal values, each in its own storage."""
    x = torch.arange(24.0).reshape(4, 6)
    obj = {"x": x, "t": x.t(), "tail": x[2:], "col": x[:, 1]}
    for got in through_zipslice(obj, tmp_path):
        for k in obj:
            assert torch.equal(got[k], obj[k]), k


def test_safetensors_to_torch_via_save(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int32)}
    save_file(t, tmp_path / "x.safetensors", metadata={"origin": "test"})
    with zipslice.load(tmp_path / "x.safetensors") as lsd:
        zipslice.save(tmp_path / "x.pt", lsd)
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert_same(got, {k: t[k] for k in got}) and sorted(got) == ["a", "b"]


def test_save_from_tensors_and_arrays(tmp_path):
    import ml_dtypes

    items = [("t", torch.randn(3)), ("n", np.arange(5, dtype=np.int16)),
             ("bf", np.array([1.5, -2], dtype=ml_dtypes.bfloat16))]
    zipslice.save(tmp_path / "mix.pt", items)
    got = torch.load(tmp_path / "mix.pt", weights_only=True)
    assert torch.equal(got["t"], items[0][1])
    assert got["n"].dtype == torch.int16 and got["n"].tolist() == [0, 1, 2, 3, 4]
    assert got["bf"].dtype == torch.bfloat16 and got["bf"].tolist() == [1.5, -2.0]


# -- property: any tree of containers, plain values and tensors of any dtype --------------------------

def _tensor(draw_dtype: str, shape: tuple, seed: int) -> torch.Tensor:
    n = math.prod(shape) * dtypes.get(draw_dtype).itemsize
    if n == 0:
        return torch.empty(shape, dtype=getattr(torch, draw_dtype))
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if draw_dtype == "bool":
        raw %= 2
    return torch.from_numpy(raw).view(getattr(torch, draw_dtype)).reshape(shape)


tensors = hs.builds(_tensor, hs.sampled_from(DTYPES), hs.lists(hs.integers(0, 4), max_size=3).map(tuple),
                    hs.integers(0, 2 ** 32 - 1))
params = tensors.filter(lambda t: t.is_floating_point()).map(
    lambda t: torch.nn.Parameter(t, requires_grad=t.dtype in (torch.float32, torch.float64)))
plain = (hs.none() | hs.booleans() | hs.integers(-(2 ** 80), 2 ** 80) | hs.floats(allow_nan=True)
         | hs.text(max_size=8) | hs.binary(min_size=1, max_size=8))  # torch.save pickles b"" as bytes(),
# which torch.load(weights_only=True) itself refuses; zipslice's writer emits _codecs.encode for it instead
keys = hs.text(alphabet="abcxyz._-0123456789", min_size=1, max_size=6)
leaves = tensors | params | plain
trees = hs.recursive(
    leaves,
    lambda kids: (hs.lists(kids, max_size=4) | hs.lists(kids, max_size=4).map(tuple)
                  | hs.dictionaries(keys, kids, max_size=4)
                  | hs.dictionaries(keys, kids, max_size=4).map(OrderedDict)),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hs.dictionaries(keys, trees, min_size=1, max_size=4))
def test_any_tree_round_trips(obj):
    with tempfile.TemporaryDirectory() as d:
        for got in through_zipslice(obj, Path(d)):
            assert_same(got, obj)


@settings(max_examples=25, deadline=None)
@given(hs.dictionaries(keys, tensors, min_size=1, max_size=5))
def test_forced_zip64_round_trips(obj):
    with tempfile.TemporaryDirectory() as d:
        for got in through_zipslice(obj, Path(d), {"force_zip64": True}):
            assert_same(got, obj)
