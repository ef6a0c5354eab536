"""Bit-for-bit comparison of torch values (tensors, nested containers) and random tensors of every dtype."""
from __future__ import annotations

import numpy as np
import torch

from zipslice import dtypes


ALL_DTYPES = [d.name for d in dtypes.BY_NAME.values()]


def bits(t: torch.Tensor) -> bytes:
    c = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1)  # fresh: strides of size-1 dims too
    return c.view(torch.uint8).numpy().tobytes() if c.numel() else b""


def assert_same(got, want, key=""):
    assert type(got) is type(want), key
    assert got.dtype == want.dtype, key
    assert got.shape == want.shape, key
    assert got.stride() == want.stride(), key
    assert got.requires_grad == want.requires_grad, key
    assert bits(got) == bits(want), key


def assert_tree_same(got, want, path="root"):
    """Same container types, keys, values; tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert_same(got, want, path)
        return
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_tree_same(got[k], want[k], f"{path}/{k}")
        if hasattr(want, "_metadata"):
            assert got._metadata == want._metadata, path
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree_same(g, w, f"{path}/{i}")
    elif isinstance(want, float) and want != want:
        assert got != got
    else:
        assert got == want, path


def random_tensor(dtype: str, shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = dtypes.get(dtype)
    n = int(np.prod(shape)) if shape else 1
    if dtype == "bool":
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtypes.to_torch(dtype)).reshape(tuple(shape))
