"""Property: for random nested state dicts of random dtypes, shapes and views, the lazy reader returns
exactly what torch.load(weights_only=True) returns (bits, dtype, shape, strides, Parameter-ness, ties)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st

import zipslice
from zipslice import dtypes, structure

from support.torch_compare import ALL_DTYPES, assert_tree_same, random_tensor

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(shapes)
    t = random_tensor(dtype, shape, seed=draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["plain", "transpose", "slice", "expand", "step", "param"]))
    if kind == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif kind == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif kind == "step" and t.dim() >= 1:
        t = t[::2]
    elif kind == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif kind == "param":
        t = torch.nn.Parameter(t, requires_grad=dtypes.get(dtype).is_float and draw(st.booleans()))
    return t


keys = st.text(alphabet="abcxyz_.0123", min_size=1, max_size=6)
leaves = tensors() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.none() | st.booleans() | keys
trees = st.recursive(
    leaves,
    lambda children: st.dictionaries(keys, children, max_size=4) | st.lists(children, max_size=3)
    | st.lists(children, max_size=3).map(tuple),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(tree=st.dictionaries(keys, trees, min_size=1, max_size=4), protocol=st.sampled_from([2, 3, 4, 5]),
       tie=st.booleans(), use_mmap=st.booleans())
def test_random_state_dicts_match_torch_load(tree, protocol, tie, use_mmap):
    tensors_in = [v for v in tree.values() if isinstance(v, torch.Tensor)]
    if tie and tensors_in:
        tree["tied_copy"] = tensors_in[0]  # the same tensor under two names: one storage
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sd.pt"
        torch.save(tree, path, pickle_protocol=protocol)
        # our own freshly written file: torch's weights-only unpickler lacks protocol 3-5 opcodes
        want = torch.load(path, weights_only=protocol == 2)
        with zipslice.load(path, mmap=use_mmap) as lsd:
            got = structure.build(lsd.structure, lsd.__getitem__)
            assert_tree_same(got, want)
            if tie and tensors_in and tensors_in[0].numel():
                a = got["tied_copy"]
                first = next(k for k, v in tree.items() if v is tensors_in[0])
                assert got[first].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
