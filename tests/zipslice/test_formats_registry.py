"""Formats are plugins: the built-ins come from the same entry points a third party would use."""
from importlib.metadata import entry_points

import numpy as np
import pytest

import zipslice
from zipslice import formats


def test_builtin_formats_are_registered_as_entry_points():
    names = {ep.name for ep in entry_points(group="zipslice.formats")}
    assert {"torch", "torch-legacy", "safetensors", "hdf5", "sharded"} <= names
    assert formats.get("safetensors").reader_class().__name__ == "SafetensorsCheckpoint"


def test_output_format_follows_the_registered_extensions():
    assert zipslice.format_for_path("a/model.PT") == "torch"
    assert zipslice.format_for_path("m.safetensors") == "safetensors"
    assert zipslice.format_for_path("w.weights.h5") == "hdf5"
    assert zipslice.format_for_path("model.safetensors.index.json") == "sharded"
    with pytest.raises(ValueError, match="pass format="):
        zipslice.format_for_path("model.xyz")


def test_unknown_and_unwritable_formats_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint format 'onnx'"):
        zipslice.save(tmp_path / "m.onnx", {"a": np.zeros(2, "<f4")}, format="onnx")
    with pytest.raises(ValueError, match="cannot write format 'torch-legacy'"):
        zipslice.save(tmp_path / "m.pt", {"a": np.zeros(2, "<f4")}, format="torch-legacy")


def test_a_plugin_format_is_found_by_its_detect_function(tmp_path, monkeypatch):
    spec = formats.FormatSpec("npy-test", "support.npy_plugin:NpyCheckpoint", detect="support.npy_plugin:detect")
    monkeypatch.setitem(formats.registry(), "npy-test", spec)
    p = tmp_path / "x.npy"
    np.save(p, np.arange(6, dtype="<f4").reshape(2, 3))
    with zipslice.load(p) as lsd:
        assert list(lsd) == ["array"]
        assert np.array_equal(lsd.numpy("array"), np.arange(6, dtype="<f4").reshape(2, 3))
