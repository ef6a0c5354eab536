"""theta.model.statedict: a state dict in memory read as the checkpoint torch.save would write, without copying it."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import zipslice
from theta.base.errors import CheckpointError
from theta.model.statedict import StateDictCheckpoint


def _as_file(obj, tmp_path):
    path = tmp_path / "ref.pt"
    torch.save(obj, path)
    return zipslice.load(path)


def _same_view(got, want):
    assert list(got) == list(want)
    assert got.format == want.format == "torch"
    assert got.structure == want.structure
    assert got.extras == want.extras
    for k in want:
        a, b = got.info(k), want.info(k)
        assert (a.dtype, a.shape, a.is_parameter, a.requires_grad) == (b.dtype, b.shape, b.is_parameter,
                                                                       b.requires_grad), k
        assert bytes(got.read_bytes(k)) == bytes(want.read_bytes(k)), k


def test_a_module_state_dict_reads_as_its_torch_save_file(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    model[1].running_mean += 0.5  # a buffer that is not all zeros
    sd = model.state_dict()  # an OrderedDict with _metadata (module versions) and an int64 buffer
    with _as_file(sd, tmp_path) as want:
        got = StateDictCheckpoint(sd, "model.pt")
        _same_view(got, want)
        assert "metadata" in got.structure  # the OrderedDict's _metadata kept


def test_nested_containers_plain_values_parameters_and_ties(tmp_path):
    w = torch.nn.Parameter(torch.randn(4, 3))
    tied = torch.randn(7, 2, dtype=torch.bfloat16)
    obj = {"model": OrderedDict([("w", w), ("emb", tied), ("head", tied)]),
           "optim": [{"lr": 0.5, "betas": (0.9, 0.999), "step": 3, "name": "adam", "none": None}],
           "shape": torch.Size([2, 3]), "dtype": torch.float16, "raw": b"\x00\x01",
           "arr": np.arange(5, dtype=np.int32)}
    with _as_file({**obj, "arr": torch.from_numpy(obj["arr"])}, tmp_path) as want:
        got = StateDictCheckpoint(obj, "ckpt.pt")
        _same_view(got, want)
        # one view under two names: tied, as torch.save records it (theta stores one group and an alias)
        assert got.source("model/emb").tie == got.source("model/head").tie is not None
        assert got.source("model/w").tie != got.source("model/emb").tie
        assert got.info("model/w").is_parameter and got.info("model/w").requires_grad


def test_bytes_are_read_in_place_and_read_only():
    t = torch.randn(300, 7)
    a = np.arange(40, dtype=np.float64)
    lsd = StateDictCheckpoint({"t": t, "a": a}, "m.pt")
    raw = lsd.numpy("t", raw=True)
    assert np.shares_memory(raw, t.numpy()) and np.shares_memory(lsd.numpy("a"), a)
    assert not raw.flags.writeable
    with pytest.raises(ValueError):
        raw[0, 0] = 1  # an encoder can never write into the caller's model
    # piece by piece (what the clean hashes and what a frame pass reads): the same bytes, no copy of the whole
    buf = bytearray(1000)
    assert b"".join(bytes(p) for p in lsd.iter_plain("t", buf)) == t.numpy().tobytes()
    piece = bytearray(64)
    lsd.read_plain_into("t", 128, piece)
    assert bytes(piece) == t.numpy().tobytes()[128:192]
    assert lsd.plain_range("t") == ("m.pt", 0, t.numel() * 4)


def test_strided_and_big_endian_values_are_copied_once():
    t = torch.randn(5, 8).t()           # a transposed view: not contiguous
    a = np.arange(6, dtype=">i4")       # big-endian
    lsd = StateDictCheckpoint({"t": t, "a": a}, "m.pt")
    assert lsd.plain_range("t") is None and lsd.iter_plain("t", bytearray(8)) is None
    assert bytes(lsd.read_bytes("t")) == t.contiguous().numpy().tobytes()
    assert lsd.numpy("a").tolist() == list(range(6)) and lsd.numpy("a").dtype == np.dtype("<i4")
    assert torch.equal(lsd["t"], t)


@pytest.mark.parametrize("obj, problem", [
    ([torch.ones(2)], "must be a mapping"),
    ({"a": object()}, "entry 'a': a object value cannot be stored"),
    ({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}}, "two leaves flatten to the same name"),
    ({"a": {(1, 2): torch.ones(1)}}, "a dict key of type tuple"),
    ({"a": np.array(["x"])}, "numpy dtype <U1 is not supported"),
])
def test_what_torch_save_could_not_write_back_is_refused_naming_the_entry(obj, problem):
    with pytest.raises(CheckpointError, match=problem):
        StateDictCheckpoint(obj, "m.pt")


def test_a_tensor_in_metadata_is_refused():
    sd = OrderedDict(w=torch.ones(2))
    sd._metadata = {"": {"t": torch.ones(1)}}
    with pytest.raises(CheckpointError, match="a tensor inside an OrderedDict's _metadata"):
        StateDictCheckpoint(sd, "m.pt")
