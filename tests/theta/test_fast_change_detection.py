"""Clean recognises unchanged groups by their xxh3-128 (GroupMeta.fast, the "xxh3" field of a group line)
instead of hashing every unchanged byte for its name; metadata written before the field keeps working (the
value names decide there, and the text it describes is not rewritten just to add the field).

Real files (safetensors), a real store; the only stand-in is a spy on theta's own value-hash helper
(content_hash), to count which bytes it hashed."""
import dataclasses
import re

import numpy as np
import pytest
import safetensors.numpy
import xxhash

import theta.model.clean
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.base.errors import MetadataError
from theta.storage import metadata
from theta.storage.store import LfsStore


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "lfs" / "objects")


def save(path, arrays):
    safetensors.numpy.save_file(arrays, str(path))


def model(seed=0):
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((64, 32), dtype=np.float32) for i in range(4)} | {
        "ids": np.arange(10, dtype=np.int64)}


def first_version(tmp_path, store):
    """The model saved as safetensors and cleaned once: (arrays, path, metadata of that first clean)."""
    arrays = model()
    p = tmp_path / "m.safetensors"
    save(p, arrays)
    return arrays, p, clean_checkpoint(p, store)


def without_fast(meta):
    """The same metadata as a theta before fast hashes wrote it."""
    return dataclasses.replace(meta, groups={k: dataclasses.replace(g, fast=None) for k, g in meta.groups.items()})


def value_hash_spy(monkeypatch):
    """Record the size of every array clean hashes for its name (theta.model.clean.content_hash)."""
    hashed = []
    real = theta.model.clean.content_hash
    monkeypatch.setattr(theta.model.clean, "content_hash", lambda a, like=None: hashed.append(a.nbytes) or real(a, like))
    return hashed


def test_every_group_records_the_xxh3_of_its_bytes(tmp_path, store):
    arrays = model()
    save(tmp_path / "m.safetensors", arrays)
    meta = clean_checkpoint(tmp_path / "m.safetensors", store)
    for name, a in arrays.items():
        assert meta.groups[name].fast == xxhash.xxh3_128_hexdigest(a.tobytes())
    text = metadata.dumps(meta)
    assert re.search(r'"group":"w0".*"xxh3":"[0-9a-f]{32}"\}$', text, re.M)
    assert metadata.loads(text).groups["w0"].fast == meta.groups["w0"].fast


def test_unchanged_groups_are_not_hashed_for_a_name(tmp_path, store, monkeypatch):
    arrays, p, first = first_version(tmp_path, store)
    arrays["w2"] = arrays["w2"] * np.float32(2)
    save(p, arrays)
    hashed = value_hash_spy(monkeypatch)
    stats = CleanStats()
    second = clean_checkpoint(p, store, first, stats=stats)
    assert stats.unchanged == 4 and stats.written == 1
    # the changed group only: its new content hash (its previous value, decoded to encode the change against,
    # is one dense blob this store bound to its hash, whose frame checksums prove it: not hashed again)
    assert hashed == [arrays["w2"].nbytes]
    assert second.groups["w2"].hash != first.groups["w2"].hash
    for k in ("w0", "w1", "w3", "ids"):
        assert second.groups[k] == first.groups[k]


def test_metadata_without_fast_hashes_still_detects_unchanged_groups(tmp_path, store, monkeypatch):
    arrays = model()
    p = tmp_path / "m.safetensors"
    save(p, arrays)
    old = without_fast(clean_checkpoint(p, store))
    old_text = metadata.dumps(old)
    assert '"xxh3"' not in old_text and metadata.loads(old_text).groups["w0"].fast is None
    hashed = value_hash_spy(monkeypatch)
    stats = CleanStats()
    before = store.written_objects
    again = clean_checkpoint(p, store, metadata.loads(old_text), stats=stats)
    # the names decide (as before the field existed): every group hashed once, all unchanged, nothing stored
    assert sorted(hashed) == sorted(a.nbytes for a in arrays.values())
    assert stats.unchanged == 5 and store.written_objects == before
    new_text = metadata.dumps(again)
    # the groups gain their fast hash; the texts describe the same thing (the filter keeps the committed bytes)
    assert all(g.fast is not None for g in again.groups.values())
    assert new_text != old_text and metadata.same_content(old_text, new_text)


def test_same_content_still_sees_a_changed_group(tmp_path, store):
    arrays, p, first = first_version(tmp_path, store)
    arrays["w1"][0, 0] += 1
    save(p, arrays)
    second = clean_checkpoint(p, store, first)
    assert not metadata.same_content(metadata.dumps(without_fast(first)), metadata.dumps(second))
    assert not metadata.same_content(metadata.dumps(first), metadata.dumps(second))


def test_a_stale_fast_hash_falls_back_to_sha256(tmp_path, store):
    arrays, p, first = first_version(tmp_path, store)
    wrong = dataclasses.replace(first, groups={**first.groups,
                                               "w0": dataclasses.replace(first.groups["w0"], fast="0" * 32)})
    stats = CleanStats()
    again = clean_checkpoint(p, store, wrong, stats=stats)
    assert stats.unchanged == 5 and again.groups["w0"].steps == first.groups["w0"].steps
    assert again.groups["w0"].fast == first.groups["w0"].fast  # the value's own fast hash, not the stale one


def test_exact_mode_decides_by_sha256(tmp_path, store):
    """With exact=True only identical bytes (by sha256) count as unchanged, whatever the fast hash says."""
    arrays, p, first = first_version(tmp_path, store)
    arrays["w3"] = arrays["w3"] + np.float32(1)
    save(p, arrays)
    new_fast = xxhash.xxh3_128_hexdigest(arrays["w3"].tobytes())
    # previous metadata whose fast hash claims w3's new bytes (as a collision would)
    claimed = dataclasses.replace(first, groups={**first.groups,
                                                 "w3": dataclasses.replace(first.groups["w3"], fast=new_fast)})
    stats = CleanStats()
    exact = clean_checkpoint(p, store, claimed, CleanOptions(exact=True), stats=stats)
    assert stats.written == 1 and exact.groups["w3"].hash != first.groups["w3"].hash


@pytest.mark.parametrize("bad", ["", "0" * 31, "0" * 33, "A" * 32, 7, None])
def test_a_bad_fast_hash_is_refused_naming_the_field(tmp_path, store, bad):
    save(tmp_path / "m.safetensors", {"w": np.ones(3, np.float32)})
    text = metadata.dumps(clean_checkpoint(tmp_path / "m.safetensors", store))
    forged = re.sub(r'"xxh3":"[0-9a-f]{32}"', '"xxh3":' + ("null" if bad is None else
                                                          str(bad) if isinstance(bad, int) else f'"{bad}"'), text)
    with pytest.raises(MetadataError, match="xxh3"):
        metadata.loads(forged, file="m.safetensors")


def test_a_chain_built_in_this_store_is_not_hashed_again(tmp_path, store, monkeypatch):
    """A previous value whose chain (dense + delta) this store built and bound is rebuilt from checksummed
    frames without a sha256; without the bindings (blobs fetched from elsewhere) every step's value is hashed."""
    import shutil

    from theta.model.clean import CleanOptions

    chains = CleanOptions(keyframe_ratio=float("inf"))  # keyframes off: steps on the previous values
    arrays, p, first = first_version(tmp_path, store)
    arrays["w2"] = arrays["w2"] * np.float32(1.001)
    save(p, arrays)
    second = clean_checkpoint(p, store, first, chains)
    assert [s.type for s in second.groups["w2"].steps] == ["dense", "delta"]
    arrays["w2"] = arrays["w2"] * np.float32(1.001)
    save(p, arrays)
    hashed = value_hash_spy(monkeypatch)
    third = clean_checkpoint(p, store, second, chains)
    assert hashed == [arrays["w2"].nbytes]  # the new value's content hash only
    assert [s.type for s in third.groups["w2"].steps] == ["dense", "delta", "delta"]
    shutil.rmtree(store.objects_dir.parent / "theta-verified")  # as if the blobs came from a remote
    hashed.clear()
    import theta.updates.rebuild
    rebuilt = []
    real = theta.updates.rebuild.content_hash  # the chain's rebuild hashes through its own name for it
    monkeypatch.setattr(theta.updates.rebuild, "content_hash",
                        lambda a, like=None: rebuilt.append(a.nbytes) or real(a, like))
    again = clean_checkpoint(p, store, second, chains)
    assert again.groups["w2"] == third.groups["w2"]
    # the new value, the previous value (on the hash thread) and the chain's intermediate value
    assert hashed == [arrays["w2"].nbytes] * 2 and rebuilt == [arrays["w2"].nbytes]


def whole_reads_spy(monkeypatch):
    """Record the names of the groups clean reads whole (zipslice's LazyCheckpoint.numpy)."""
    import zipslice.base

    read = []
    real = zipslice.base.LazyCheckpoint.numpy
    monkeypatch.setattr(zipslice.base.LazyCheckpoint, "numpy",
                        lambda self, key, raw=False: read.append(key) or real(self, key, raw))
    return read


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_unchanged_groups_are_hashed_in_place_not_read_whole(tmp_path, store, monkeypatch, fmt):
    arrays = model()
    p = tmp_path / f"m.{fmt}"

    def write():
        if fmt == "torch":
            import torch

            torch.save({k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, p)
        else:
            save(p, arrays)

    write()
    first = clean_checkpoint(p, store)
    arrays["w1"] = arrays["w1"] + np.float32(1)
    write()
    read = whole_reads_spy(monkeypatch)
    monkeypatch.setattr(theta.model.clean, "_HASH_PIECE", 100)  # several pieces per group (a fresh thread's buffer)
    stats = CleanStats()
    second = clean_checkpoint(p, store, first, stats=stats)
    assert read == ["w1"]  # only the changed group is read whole (the others cost their streamed xxh3)
    assert stats.unchanged == 4 and stats.written == 1
    for k in ("w0", "w2", "w3", "ids"):
        assert second.groups[k] == first.groups[k]
    assert second.groups["w1"].fast == xxhash.xxh3_128_hexdigest(arrays["w1"].tobytes())


def test_a_sideloaded_group_is_still_read_whole(tmp_path, store, monkeypatch):
    """_read_group(whole=True): the value is needed even when its bytes did not change."""
    arrays, p, first = first_version(tmp_path, store)
    import zipslice

    with zipslice.load(p) as lsd:
        got = theta.model.clean._read_group(lsd, "w0", first, whole=True)
        assert got.raw is not None and got.digest == first.groups["w0"].hash
        assert np.array_equal(got.arr, arrays["w0"])
        lean = theta.model.clean._read_group(lsd, "w0", first)
        assert lean.raw is None and lean.arr is None and lean.digest == first.groups["w0"].hash
        assert lean.fast == first.groups["w0"].fast


def test_a_changed_or_new_group_is_named_on_the_hash_thread(tmp_path, store, monkeypatch):
    """The hash of a group known to be changed (its fast hash is not its previous one's) or new only names its
    value: it is taken on the hash thread while the reader signs the group, and the metadata holds it (BLAKE3)."""
    import threading

    import blake3

    from theta.base import parallel

    if parallel.CODEC_THREADS <= 1:
        pytest.skip("GIT_THETA_THREADS=1: every pool runs inline")
    arrays, p, first = first_version(tmp_path, store)
    arrays["w1"] = arrays["w1"] * np.float32(1.001)
    arrays["new"] = np.ones((8, 8), np.float32)
    save(p, arrays)
    threads = {}
    real = theta.model.clean.content_hash
    monkeypatch.setattr(theta.model.clean, "content_hash",
                        lambda a, like=None: threads.setdefault(a.nbytes, threading.current_thread().name) and real(a, like))
    second = clean_checkpoint(p, store, first)
    assert set(threads) == {arrays["w1"].nbytes, arrays["new"].nbytes}
    assert all(name.startswith("theta-hash") for name in threads.values()), threads
    for key in ("w1", "new"):
        assert second.groups[key].hash == "blake3:" + blake3.blake3(arrays[key].tobytes()).hexdigest()
    assert [second.groups[k].steps for k in ("w0", "w2", "w3", "ids")] == \
        [first.groups[k].steps for k in ("w0", "w2", "w3", "ids")]
