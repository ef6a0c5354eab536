"""theta.updates.keyframe: auto stores a changed group so that a fresh checkout fetches at most
theta.keyframeRatio x what the value alone costs, and a fine-tune of a float32 group is one small step on its
keyframe however long the history -- exactly, bit for bit.

Real safetensors files, a real store, the clean filter's own entry point (clean_checkpoint)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import safetensors.numpy

from theta.base.errors import ThetaError, UpdateTypeError
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.settings import clean_options
from theta.storage import codec, metadata
from theta.storage.store import LfsStore
from theta.updates import keyframe
from theta.updates.delta import _uncombine, combine, raw_words
from theta.updates.rebuild import reconstruct

ROWS, COLS = 512, 256  # 512 KiB of float32: above keyframe.SPLIT_MIN_BYTES


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "objects")


def tune(x: np.ndarray, seed: int, scale: float = 1e-3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (x * (1 + np.asarray(scale, x.dtype) * rng.standard_normal(x.shape).astype(x.dtype))).astype(x.dtype)


def first(seed=0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": (rng.standard_normal((ROWS, COLS)) * 0.02).astype(dtype),
            "b": (rng.standard_normal(COLS) * 0.02).astype(dtype)}


def kinds(meta, key="w") -> list[str]:
    return [s.type + (f":{s.params['op']}" if s.type == "delta" else "") for s in meta.groups[key].steps]


def commit(tmp_path, store, arrays, previous, options=None, stats=None):
    """Clean ``arrays`` against ``previous`` and check every group rebuilds bit for bit from a fresh text."""
    p = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(p))
    meta = metadata.loads(metadata.dumps(clean_checkpoint(p, store, previous, options, stats=stats)))
    for k, v in arrays.items():
        assert reconstruct(meta.groups[k], store, verify=True).tobytes() == v.tobytes()
    return meta


def dense_size(value: np.ndarray) -> int:
    return len(codec.encode_parts({"values": value}))


@pytest.mark.parametrize("dtype,op", [(np.float32, "split18"), (np.float64, "split50")])
def test_split_codes_rebuild_every_bit_pattern(dtype, op):
    """Any new and previous words (NaN payloads, infinities, -0, subnormals, random bits) round-trip, in place
    too, against a full previous value and against a keyframe's high part (low bits zero)."""
    rng = np.random.default_rng(3)
    word = raw_words(np.empty(0, dtype)).dtype
    new = rng.integers(0, np.iinfo(word).max, 4096, dtype=word, endpoint=True)
    prev = rng.integers(0, np.iinfo(word).max, 4096, dtype=word, endpoint=True)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(dtype).tiny / 2, 1.0], dtype)
    new[:8], prev[8:16] = special.view(word), special.view(word)
    high, low = keyframe.masks(word, op)
    for base in (prev, prev & high):
        codes = combine(new, base, op)
        assert np.array_equal(_uncombine(codes, base, op), new)
        inplace = base.copy()
        _uncombine(codes, inplace, op, out=inplace)
        assert np.array_equal(inplace, new)
    assert not np.any(combine(new, new & high, op) & high)  # on its own high part: the low bits alone
    if word == np.uint32:  # a forged step naming float64's split on float32 words
        with pytest.raises(UpdateTypeError, match="wider"):
            combine(new, prev, "split50")


def test_a_first_version_is_a_split_keyframe_costing_a_dense_blob(tmp_path, store):
    arrays = first()
    meta = commit(tmp_path, store, arrays, None)
    assert kinds(meta) == ["dense", "delta:split18"] and kinds(meta, "b") == ["dense"]  # b: too small to split
    high = meta.groups["w"].steps[0]
    assert reconstruct(dataclasses.replace(meta.groups["w"], steps=[high], hash=high.hash), store).tobytes() == \
        (raw_words(arrays["w"]) & np.uint32(0xFFFC0000)).tobytes()
    assert keyframe.fetch_bytes(meta.groups["w"].steps) <= 1.01 * dense_size(arrays["w"])
    text = metadata.dumps(meta)
    assert text.startswith(f"theta-metadata {metadata.SPLIT_VERSION}\n")
    # a reader of version 3 cannot say what a split step means: the text says 4, and 3 with one is refused
    with pytest.raises(ThetaError, match="split delta step needs metadata version 4"):
        metadata.loads(text.replace(f"theta-metadata {metadata.SPLIT_VERSION}", "theta-metadata 3", 1))


def test_fine_tunes_are_one_small_step_on_the_keyframe(tmp_path, store):
    """Five fine-tunes in a row: each chain is the first version's high part and one split step; a fresh
    checkout fetches at most keyframeRatio x a dense blob, a pull (previous version local) ~0.55 of the raw
    bytes -- where appending deltas made the fifth fetch 1 + 5 x 0.6 dense blobs."""
    arrays = first()
    metas = [commit(tmp_path, store, arrays, None)]
    raw = arrays["w"].nbytes
    for i in range(5):
        before = store.written_bytes
        arrays = {k: tune(v, 10 + i) for k, v in arrays.items()}
        metas.append(commit(tmp_path, store, arrays, metas[-1]))
        w = metas[-1].groups["w"]
        assert kinds(metas[-1]) == ["dense", "delta:split18"] and w.steps[0] == metas[0].groups["w"].steps[0]
        assert keyframe.fetch_bytes(w.steps) <= keyframe.DEFAULT_RATIO * dense_size(arrays["w"])
        assert w.steps[1].blob.size < 0.6 * raw  # the step a pull fetches
        assert store.written_bytes - before < 0.62 * raw + 16 * arrays["b"].nbytes


def test_a_sparse_change_is_appended_when_the_chain_still_fits(tmp_path, store):
    arrays = first()
    m1 = commit(tmp_path, store, arrays, None)
    edited = dict(arrays, w=arrays["w"].copy())
    edited["w"][::97, :3] += 1.0  # a few rows' first elements
    m2 = commit(tmp_path, store, edited, m1)
    assert kinds(m2) == ["dense", "delta:split18", "sparse"] and m2.groups["w"].steps[:2] == m1.groups["w"].steps


def test_a_chain_that_would_not_fit_becomes_a_keyframe(tmp_path, store):
    """A dense first version (committed before keyframes) fine-tuned: a delta on it would make a checkout fetch
    1.6 dense blobs, so the new value is a keyframe; a value far from its keyframe's high bits, and a ratio of
    1, give a new keyframe too."""
    arrays = first()
    legacy = commit(tmp_path, store, arrays, None, CleanOptions(update_type="dense"))
    assert kinds(legacy) == ["dense"]
    tuned = {k: tune(v, 1) for k, v in arrays.items()}
    m = commit(tmp_path, store, tuned, legacy)
    assert kinds(m) == ["dense", "delta:split18"] and m.groups["w"].steps[0] != legacy.groups["w"].steps[0]
    far = first(seed=9)  # other values altogether: every high part moves
    m2 = commit(tmp_path, store, far, m)
    assert kinds(m2) == ["dense", "delta:split18"] and m2.groups["w"].steps[0] != m.groups["w"].steps[0]
    m3 = commit(tmp_path, store, {k: tune(v, 3) for k, v in far.items()}, m2, CleanOptions(keyframe_ratio=1.0))
    assert m3.groups["w"].steps[0] != m2.groups["w"].steps[0]
    off = commit(tmp_path, store, {k: tune(v, 3) for k, v in far.items()}, m2,
                 CleanOptions(keyframe_ratio=float("inf")))  # keyframes off: a delta on the previous value
    assert kinds(off) == ["dense", "delta:split18", "delta:zigzag"]


def test_bfloat16_and_float16_stay_dense_keyframes_with_small_deltas(tmp_path, store):
    import ml_dtypes

    for dtype in (np.float16, ml_dtypes.bfloat16):
        rng = np.random.default_rng(5)
        arrays = {"w": (rng.standard_normal((ROWS, COLS)) * 0.02).astype(dtype)}
        m1 = commit(tmp_path, store, arrays, None)
        assert kinds(m1) == ["dense"]
        m2 = commit(tmp_path, store, {"w": tune(arrays["w"].astype(np.float32), 1).astype(dtype)}, m1)
        assert keyframe.fetch_bytes(m2.groups["w"].steps) <= keyframe.DEFAULT_RATIO * dense_size(arrays["w"]) * 1.01


def test_a_keyframe_whose_blob_does_not_give_its_value_is_not_built_on(tmp_path, store):
    """The rebase reads the keyframe's high part straight from its blob: when that blob does not decode to the
    value its step names (metadata naming another value), the new version is stored as a keyframe of its own
    and the clean says why."""
    arrays = first()
    m1 = commit(tmp_path, store, arrays, None)
    w = m1.groups["w"]
    forged_first = dataclasses.replace(w.steps[0], hash=m1.groups["b"].hash)
    forged = dataclasses.replace(m1, groups=dict(m1.groups, w=dataclasses.replace(w, steps=[forged_first,
                                                                                           w.steps[1]])))
    stats = CleanStats()
    p = tmp_path / "m.safetensors"
    tuned = {k: tune(v, 1) for k, v in arrays.items()}
    safetensors.numpy.save_file(tuned, str(p))
    # the previous value cannot be rebuilt either (its chain's first value is named wrongly): no delta on it
    meta = clean_checkpoint(p, store, forged, stats=stats)
    assert any(w.startswith("w: previous version unusable") for w in stats.warnings), stats.warnings
    assert kinds(meta) == ["dense", "delta:split18"] and meta.groups["w"].steps[0] != forged_first
    assert reconstruct(meta.groups["w"], store, verify=True).tobytes() == tuned["w"].tobytes()


def test_the_ratio_is_a_setting(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert clean_options(repo).keyframe_ratio == keyframe.DEFAULT_RATIO
    subprocess.run(["git", "-C", str(repo), "config", "theta.keyframeRatio", "1.5"], check=True)
    assert clean_options(repo).keyframe_ratio == 1.5
    monkeypatch.setenv("GIT_THETA_KEYFRAME_RATIO", "inf")
    assert clean_options(repo).keyframe_ratio == float("inf")
    for bad in ("0.9", "nan", "many"):
        monkeypatch.setenv("GIT_THETA_KEYFRAME_RATIO", bad)
        with pytest.raises(ThetaError, match="KEYFRAME_RATIO|keyframeRatio"):
            clean_options(repo)
