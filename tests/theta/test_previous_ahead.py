"""Clean rebuilds a changed group's previous value ahead of its encoding, on its own thread, beside the sha256
and the signature of its new bytes (issue #17: the largest group's costs side by side, not one after another).

Real files (safetensors), a real store; the only stand-in is a spy on theta's own rebuild helper, to see
which previous values were rebuilt and on which thread."""
import os
import threading

import numpy as np
import safetensors.numpy

import theta.clean
from theta import parallel
from theta.clean import CleanStats, clean_checkpoint
from theta.storage import metadata
from theta.storage.store import LfsStore
from theta.updates import reconstruct


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


def rebuild_spy(monkeypatch):
    calls = []
    real = theta.clean._rebuild_previous
    monkeypatch.setattr(theta.clean, "_rebuild_previous",
                        lambda key, *a: calls.append((key, threading.current_thread().name)) or real(key, *a))
    return calls


def test_each_changed_groups_previous_value_is_rebuilt_once_on_its_own_thread(tmp_path, monkeypatch):
    store = LfsStore(tmp_path / "objects")
    p, first, second = two_versions(tmp_path, store)
    calls = rebuild_spy(monkeypatch)
    stats = CleanStats()
    meta = clean_checkpoint(p, store, first, stats=stats)
    changed = sorted(k for i, k in enumerate(second) if i % 2 == 0)
    assert sorted(k for k, _ in calls) == changed  # once each, and never for an unchanged group
    if parallel.CODEC_THREADS > 1:
        assert {t for _, t in calls} == {"theta-previous_0"}
    assert stats.written == len(changed) and stats.unchanged == len(second) - len(changed)
    for k in changed:
        assert [s.type for s in meta.groups[k].steps] == ["dense", "delta"]  # encoded against that value
    for k, v in second.items():
        got = reconstruct(meta.groups[k], store)
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes()


def test_the_metadata_does_not_depend_on_how_far_clean_reads_ahead(tmp_path, monkeypatch):
    """Read ahead (the default) or group by group (no read-ahead budget): the same text, bit for bit."""
    texts = []
    for budget in (theta.clean.READ_AHEAD_BYTES, 0):
        store = LfsStore(tmp_path / f"objects-{budget}")
        d = tmp_path / str(budget)
        d.mkdir()
        p, first, _ = two_versions(d, store)
        monkeypatch.setattr(theta.clean, "READ_AHEAD_BYTES", budget)
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
    meta = clean_checkpoint(p, store, first, stats=stats)
    assert [w for w in stats.warnings if w.startswith("w02: previous version unusable")], stats.warnings
    assert [s.type for s in meta.groups["w02"].steps] == ["dense"]  # nothing built on the broken value
    assert reconstruct(meta.groups["w02"], store).tobytes() == second["w02"].tobytes()
    assert [s.type for s in meta.groups["w04"].steps] == ["dense", "delta"]  # the others as usual


def test_a_full_chain_rebuilds_nothing_ahead(tmp_path, monkeypatch):
    """A chain that cannot grow stores the change whole: its previous value is never rebuilt for it."""
    from theta.clean import CleanOptions

    store = LfsStore(tmp_path / "objects")
    p, first, second = two_versions(tmp_path, store)
    calls = rebuild_spy(monkeypatch)
    meta = clean_checkpoint(p, store, first, CleanOptions(max_chain=1))
    assert calls == []
    assert all([s.type for s in g.steps] == ["dense"] for g in meta.groups.values())
    for k, v in second.items():
        assert reconstruct(meta.groups[k], store).tobytes() == v.tobytes()
