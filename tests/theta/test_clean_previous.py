"""Clean encodes a changed group against its previous value: the same metadata, bit for bit, however far it
reads ahead, and a previous version whose blob is corrupt is stored anew with a warning, never built on.

Real files (safetensors), a real store."""
import os

import numpy as np
import safetensors.numpy

from theta.base import parallel
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.storage import metadata
from theta.storage.store import LfsStore
from theta.updates.rebuild import reconstruct


def model(seed=0, groups=12):
    rng = np.random.default_rng(seed)
    return {f"w{i:02d}": rng.standard_normal((96, 64), dtype=np.float32) for i in range(groups)}


def tuned(arrays, every=2, seed=1):
    rng = np.random.default_rng(seed)
    return {k: (v * (1 + np.float32(1e-3) * rng.standard_normal(v.shape, dtype=np.float32))).astype(np.float32)
            if i % every == 0 else v for i, (k, v) in enumerate(arrays.items())}


def two_versions(tmp_path, store):
    p = tmp_path / "m.safetensors"
    first = model()
    safetensors.numpy.save_file(first, str(p))
    meta = clean_checkpoint(p, store)
    second = tuned(first)
    safetensors.numpy.save_file(second, str(p))
    return p, meta, second


def test_the_metadata_does_not_depend_on_how_far_clean_reads_ahead(tmp_path, monkeypatch):
    """Read ahead (the default) or group by group (no read-ahead budget): the same text, bit for bit."""
    texts = []
    for budget in (parallel.READ_AHEAD_BYTES, 0):
        store = LfsStore(tmp_path / f"objects-{budget}")
        d = tmp_path / str(budget)
        d.mkdir()
        p, first, _ = two_versions(d, store)
        monkeypatch.setattr(parallel, "READ_AHEAD_BYTES", budget)
        assert parallel.read_ahead_budget() <= budget  # what clean asks for its read-ahead
        texts.append(metadata.dumps(clean_checkpoint(p, store, first)))
    assert texts[0] == texts[1]


def test_a_previous_version_whose_blob_is_corrupt_is_stored_anew_with_a_warning(tmp_path):
    store = LfsStore(tmp_path / "objects")
    p, first, second = two_versions(tmp_path, store)
    blob = store.path(first.groups["w02"].steps[0].blob)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a zstd frame: its checksum fails
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes(data))
    stats = CleanStats()
    # keyframes off: the groups this small would be stored self-contained (theta.updates.keyframe), not on
    # their previous values
    meta = clean_checkpoint(p, store, first, CleanOptions(keyframe_ratio=float("inf")), stats=stats)
    assert [w for w in stats.warnings if w.startswith("w02: previous version unusable")], stats.warnings
    assert [s.type for s in meta.groups["w02"].steps] == ["dense"]  # nothing built on the broken value
    assert reconstruct(meta.groups["w02"], store).tobytes() == second["w02"].tobytes()
    assert [s.type for s in meta.groups["w04"].steps] == ["dense", "delta"]  # the others as usual
