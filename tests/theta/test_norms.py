"""The norms clean records per group (theta.model.norms, metadata ``norms``): their figures against numpy in
float64, the same bits frame by frame and whole, the text's checks, and texts written before them."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from theta.base.errors import MetadataError
from theta.model import framewise, norms
from theta.model.clean import CleanOptions, clean_checkpoint
from theta.storage import metadata
from theta.storage.metadata import Norms, same_content
from theta.storage.store import LfsStore

DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_measure_against_numpy_in_float64(dtype):
    rng = np.random.default_rng(0)
    old = rng.normal(0, 0.02, 3 * norms.CHUNK + 1234).astype(dtype)
    new = (old.astype(np.float64) + rng.normal(0, 1e-3, old.size)).astype(dtype)
    new[::5] = old[::5]
    s = norms.measure(new, old)
    n64, o64 = new.astype(np.float64), old.astype(np.float64)
    assert math.isclose(math.sqrt(s.value), np.linalg.norm(n64), rel_tol=1e-5)  # (all alike: a few 1e-6)
    assert math.isclose(math.sqrt(s.change), np.linalg.norm(n64 - o64), rel_tol=1e-6)
    assert s.changed == int(np.count_nonzero(new.view(f"u{dtype.itemsize}") != old.view(f"u{dtype.itemsize}")))
    alone = norms.measure(new)
    assert (alone.value, alone.change, alone.changed) == (s.value, 0.0, 0)


def test_measured_frame_by_frame_is_measured_whole_bit_for_bit():
    """A codec frame is a whole number of chunks: sums added frame by frame, in order, are the sums of the
    whole value (what lets a group cleaned frame by frame record the text one read whole records)."""
    rng = np.random.default_rng(1)
    old = rng.normal(0, 1, 5 * norms.CHUNK + 77).astype(ml_dtypes.bfloat16)
    new = (old.astype(np.float32) * 1.001).astype(ml_dtypes.bfloat16)
    step = 2 * norms.CHUNK
    total = norms.Sums()
    for a in range(0, new.size, step):
        total.add(norms.measure(new[a:a + step], old[a:a + step]))
    whole = norms.measure(new, old)
    assert (total.value, total.change, total.changed) == (whole.value, whole.change, whole.changed)


def test_non_finite_values_record_no_norms():
    x = np.array([1.0, np.inf], np.float32)
    assert not norms.finite(norms.measure(x))
    assert norms.rounded(1234.56789) == 1234.57 and norms.rounded(1.234567e-9) == 1.23457e-09
    assert norms.measurable("bfloat16") and not norms.measurable("int64") and not norms.measurable("bool")


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(512, 1024, generator=g).to(torch.bfloat16),   # 1 MiB: framed at 1 MiB
            "small": torch.randn(300, 200, generator=g), "ids": torch.arange(7)}


@pytest.mark.parametrize("threshold", [1 << 20, 1 << 60], ids=["frames", "whole"])
def test_clean_records_the_norms_of_a_value_and_its_change(tmp_path, threshold, monkeypatch):
    monkeypatch.setattr(framewise, "STREAM_BYTES", threshold)
    store = LfsStore(tmp_path / "objects")
    v1 = model()
    torch.save(v1, tmp_path / "m.pt")
    m1 = clean_checkpoint(tmp_path / "m.pt", store)
    g = torch.Generator().manual_seed(9)
    v2 = {k: (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype) if t.is_floating_point() else t
          for k, t in v1.items()}
    torch.save(v2, tmp_path / "m.pt")
    m2 = clean_checkpoint(tmp_path / "m.pt", store, m1)
    assert m1.groups["ids"].norms is None and m2.groups["ids"].norms is None  # integers: none
    for name in ("embed", "small"):
        a = v1[name].float().double().numpy()
        b = v2[name].float().double().numpy()
        first, second = m1.groups[name].norms, m2.groups[name].norms
        assert first.source is None and math.isclose(first.value, np.linalg.norm(a), rel_tol=1e-5)
        assert second.source == m1.groups[name].hash
        assert math.isclose(second.value, np.linalg.norm(b), rel_tol=1e-5)
        assert math.isclose(second.change, np.linalg.norm(b - a), rel_tol=1e-5)
        assert second.changed == int(np.count_nonzero(a != b))
    text = metadata.dumps(m2)
    assert metadata.loads(text).groups["embed"].norms == m2.groups["embed"].norms
    # unchanged: the norms are the previous version's, kept with its steps
    m3 = clean_checkpoint(tmp_path / "m.pt", store, m2)
    assert metadata.dumps(m3) == text


def test_a_value_stored_whole_on_request_records_no_change(tmp_path):
    store = LfsStore(tmp_path / "objects")
    v1 = model()
    torch.save(v1, tmp_path / "m.pt")
    m1 = clean_checkpoint(tmp_path / "m.pt", store)
    torch.save(dict(v1, small=v1["small"] * 2), tmp_path / "m.pt")
    m2 = clean_checkpoint(tmp_path / "m.pt", store, m1, CleanOptions(update_type="dense"))
    n = m2.groups["small"].norms
    assert n.source is None and math.isclose(n.value, 2 * m1.groups["small"].norms.value, rel_tol=1e-5)


def group_line(**norms_field) -> str:
    h = "blake3:" + "ab" * 32
    return ('theta-metadata 3\n{"checkpoint":{"format":"safetensors","lsh":{},"metadata":{}}}\n'
            '{"structure":null}\n{"order":["w"]}\n'
            '{"dtype":"float32","group":"w","hash":"%s","norms":%s,"shape":[2,3],"steps":[{"hash":"%s",'
            '"oid":"%s","params":{},"size":100,"type":"dense"}]}\n'
            % (h, __import__("json").dumps(norms_field), h, "cd" * 32))


def test_the_text_s_norms_are_checked():
    ok = metadata.loads(group_line(value=1.5, change=0.25, changed=6, **{"from": "ef" * 32}))
    assert ok.groups["w"].norms == Norms(1.5, "ef" * 32, 0.25, 6)
    assert metadata.loads(group_line(value=0)).groups["w"].norms == Norms(0.0)
    for bad, field in ((dict(value=-1.0), "norms.value"), (dict(value="1"), "norms.value"),
                       (dict(change=1.0), "norms.value"), (dict(value=1.0, size=3), "norms.size"),
                       (dict(value=1.0, change=0.5), "norms.changed"),
                       (dict(value=1.0, change=0.5, changed=7, **{"from": "ef" * 32}), "norms.changed"),
                       (dict(value=1.0, change=0.5, changed=1, **{"from": "xyz"}), "norms.from"),
                       (dict(value=1e400), None)):
        with pytest.raises(MetadataError) as e:
            metadata.loads(group_line(**bad).replace("Infinity", "1e400"))
        if field is not None:
            assert f"field '{field}'" in str(e.value), str(e.value)


def test_texts_that_differ_only_in_norms_have_the_same_content():
    a = group_line(value=1.5)
    b = group_line(value=1.50001, change=0.25, changed=6, **{"from": "ef" * 32})
    assert same_content(a, b) and not same_content(a, a.replace('"shape":[2,3]', '"shape":[3,2]'))
    # a text written before norms reads as it always did
    old = a.replace(',"norms":{"value": 1.5}', "")
    assert '"norms"' not in old and metadata.loads(old).groups["w"].norms is None
