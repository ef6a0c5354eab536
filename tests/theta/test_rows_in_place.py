"""A ``rows`` step (vocabulary trimmed, rows deleted, reordered, appended) rebuilt from its blob: bit for bit what
``apply`` gives, and in place (a view of the previous value, no second value) when no row moves backwards and
the value does not grow. Real blobs in a real store."""
import dataclasses

import numpy as np
import pytest

from theta.storage import codec
from theta.storage.metadata import GroupMeta
from theta.storage.store import LfsStore
from theta.updates import content_hash, get, steps
from theta.updates.rebuild import reconstruct
from support.traced import traced_peak


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def group_of(store, values: list, types: list[str]) -> GroupMeta:
    links = [steps.store_dense(values[0], store)]
    for kind, prev, new in zip(types, values, values[1:]):
        enc = get(kind).encode(new, prev)
        assert enc is not None
        links.append(steps.store_step(kind, enc.parts, enc.params, content_hash(new), store))
    last = values[-1]
    # a step whose value has another shape than the group records its own (theta.updates.SHAPE_KEY)
    links = [dataclasses.replace(link, params={**link.params, "shape": list(v.shape)}) if v.shape != last.shape
             else link for link, v in zip(links, values)]
    return GroupMeta(name="embed", dtype="float32", shape=tuple(last.shape), hash=content_hash(last), steps=links)


def base(rows=300, cols=16, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)


@pytest.mark.parametrize("edit", ["trim", "delete middle rows", "delete and append", "reorder", "extend",
                                  "same rows"])
def test_rows_step_rebuilds_bit_for_bit(tmp_path, edit):
    store = LfsStore(tmp_path / "objects")
    prev = base()
    new_rows = np.random.default_rng(1).standard_normal((7, 16), dtype=np.float32)
    new = {"trim": prev[:250],
           "delete middle rows": np.concatenate([prev[:100], prev[180:]]),
           "delete and append": np.concatenate([prev[:50], prev[60:200], new_rows]),
           "reorder": np.concatenate([prev[150:], prev[:150]]),
           "extend": np.concatenate([prev, new_rows]),
           "same rows": np.concatenate([prev[:10], new_rows[:1], prev[11:]])}[edit]
    group = group_of(store, [prev, np.ascontiguousarray(new)], ["rows"])
    enc = get("rows").encode(new, prev)
    want = get("rows").apply(enc.parts, enc.params, prev)
    assert bits(want) == bits(new)
    assert bits(reconstruct(group, store)) == bits(new)


def test_a_trimmed_fine_tune_rebuilds_in_place(tmp_path, monkeypatch):
    """dense, delta, rows (trim): one value and a few frames, not the value and its trimmed copy."""
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(2)
    v0 = (rng.standard_normal((4096, 512)) * 0.02).astype(np.float32)  # 8 MiB
    v1 = (v0 * (1 + 1e-3 * rng.standard_normal(v0.shape))).astype(np.float32)
    v2 = np.ascontiguousarray(v1[:4000])
    group = group_of(store, [v0, v1, v2], ["delta", "rows"])
    want, group_bytes = bits(v2), v0.nbytes
    del v0, v1, v2
    out, peak = traced_peak(reconstruct, group, store)
    assert bits(out) == want
    assert peak <= 1.4 * group_bytes, peak / group_bytes
