"""Values named by BLAKE3, values named before by sha256 (theta.base.valuehash): the two forms side by side in
metadata, clean, checks and bindings. Real files (safetensors), a real store; the expected names are
computed here with blake3 and hashlib directly."""
import dataclasses
import hashlib
import re

import blake3
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from theta.base import valuehash
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.base.errors import IntegrityError, MetadataError
from theta.storage import metadata
from theta.storage.store import LfsStore
from theta.updates import content_hash
from theta.updates.rebuild import reconstruct


def b3(a: np.ndarray) -> str:
    return "blake3:" + blake3.blake3(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).hexdigest()


@pytest.fixture()
def store(tmp_path):
    return LfsStore(tmp_path / "objects")


def model():
    rng = np.random.default_rng(3)
    return {"w0": rng.standard_normal((64, 32)).astype(np.float32),
            "w1": rng.standard_normal((32, 32)).astype(np.float32),
            "ids": np.arange(10, dtype=np.int64)}


def save(p, arrays):
    safetensors.numpy.save_file(arrays, str(p))


def as_named_by_sha256(meta, arrays):
    """``meta`` (a first version: one dense step per group) as a theta before BLAKE3 wrote it."""
    groups = {}
    for k, g in meta.groups.items():
        name = sha(arrays[k])
        groups[k] = dataclasses.replace(g, hash=name, steps=[dataclasses.replace(s, hash=name) for s in g.steps])
    return dataclasses.replace(meta, groups=groups)


@pytest.mark.parametrize("a", [np.arange(7, dtype=np.float32), np.arange(6, dtype=">f8").reshape(2, 3),
                               np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16), np.zeros(0, np.int8)])
def test_a_value_is_named_by_the_blake3_of_its_little_endian_bytes(a):
    assert content_hash(a) == b3(a)
    assert content_hash(a, like=sha(a)) == sha(a)  # checked in the algorithm of the name it is checked against
    assert content_hash(a, like=b3(a)) == b3(a)


def test_names_and_labels():
    s, b = "ab" * 32, "blake3:" + "cd" * 32
    assert valuehash.is_name(s) and valuehash.is_name(b)
    for bad in ("AB" * 32, "ab" * 31, "blake3:" + "ab" * 31, "BLAKE3:" + "ab" * 32, "sha256:" + "ab" * 32,
                "blake3:" + "ab" * 32 + "\n", None, 7):
        assert not valuehash.is_name(bad)
    assert valuehash.label(s) == "sha256:" + s and valuehash.label(b) == b


def test_a_first_version_names_every_value_by_blake3_and_is_written_as_version_3(tmp_path, store):
    arrays = model()
    save(tmp_path / "m.safetensors", arrays)
    meta = clean_checkpoint(tmp_path / "m.safetensors", store)
    for k, a in arrays.items():
        assert meta.groups[k].hash == b3(a) == meta.groups[k].steps[-1].hash
    text = metadata.dumps(meta)
    assert text.startswith("theta-metadata 3\n")
    back = metadata.loads(text)
    assert back.version == 3 and back.groups == meta.groups and metadata.dumps(back) == text


def test_unchanged_values_keep_their_sha256_names_and_the_text_its_version(tmp_path, store):
    arrays = model()
    p = tmp_path / "m.safetensors"
    save(p, arrays)
    old = as_named_by_sha256(clean_checkpoint(p, store), arrays)
    old_text = metadata.dumps(old)
    assert old_text.startswith("theta-metadata 1\n")
    again = clean_checkpoint(p, store, metadata.loads(old_text))
    assert metadata.dumps(again) == old_text
    # without fast hashes (metadata older still) or with exact=True, the sha256 names decide, and agree
    no_fast = dataclasses.replace(old, groups={k: dataclasses.replace(g, fast=None) for k, g in old.groups.items()})
    for prev, options in ((no_fast, None), (old, CleanOptions(exact=True))):
        stats = CleanStats()
        same = clean_checkpoint(p, store, prev, options, stats=stats)
        assert stats.unchanged == 3 and {k: g.hash for k, g in same.groups.items()} == \
            {k: sha(a) for k, a in arrays.items()}


# keyframes off: these groups are small enough to be stored self-contained (theta.updates.keyframe), and the
# point is a step built on a value named by sha256
@pytest.mark.parametrize("options", [CleanOptions(keyframe_ratio=float("inf")),
                                     CleanOptions(exact=True, keyframe_ratio=float("inf"))], ids=["default", "exact"])
def test_a_changed_value_is_named_anew_and_rebuilds_against_both_names(tmp_path, store, options):
    arrays = model()
    p = tmp_path / "m.safetensors"
    save(p, arrays)
    old = as_named_by_sha256(clean_checkpoint(p, store), arrays)
    arrays["w0"] = arrays["w0"] * np.float32(1.001)
    save(p, arrays)
    new = clean_checkpoint(p, store, old, options)
    w0 = new.groups["w0"]
    assert w0.hash == b3(arrays["w0"]) and [s.hash for s in w0.steps] == [old.groups["w0"].hash, w0.hash]
    assert new.groups["w1"] == old.groups["w1"] and new.groups["ids"] == old.groups["ids"]
    assert metadata.dumps(new).startswith("theta-metadata 3\n")
    # a rebuild checks every step's value against its own name, sha256 then BLAKE3
    fresh = LfsStore(tmp_path / "objects")  # (the bindings stay; verify=True hashes every step anyway)
    assert reconstruct(w0, fresh, verify=True).tobytes() == arrays["w0"].tobytes()
    forged = dataclasses.replace(w0, steps=[dataclasses.replace(w0.steps[0], hash=sha(arrays["w1"])),
                                            w0.steps[1]])
    with pytest.raises(IntegrityError):
        reconstruct(forged, fresh, verify=True)


def test_a_blake3_name_needs_version_3(tmp_path, store):
    arrays = model()
    save(tmp_path / "m.safetensors", arrays)
    text = metadata.dumps(clean_checkpoint(tmp_path / "m.safetensors", store))
    with pytest.raises(MetadataError, match=r"m.safetensors: line 6: group 'ids'.*hash.*needs metadata version 3"):
        metadata.loads(text.replace("theta-metadata 3", "theta-metadata 1"), file="m.safetensors")


@pytest.mark.parametrize("bad", ["blake3:" + "0" * 63, "BLAKE3:" + "0" * 64, "sha256:" + "0" * 64,
                                 "blake3:" + "0" * 64 + "0", "blake3:", "b3:" + "0" * 64])
def test_a_malformed_value_name_is_refused_naming_the_field(tmp_path, store, bad):
    arrays = model()
    save(tmp_path / "m.safetensors", arrays)
    text = metadata.dumps(clean_checkpoint(tmp_path / "m.safetensors", store))
    name = re.search(r'"group":"w1","hash":"(blake3:[0-9a-f]{64})"', text).group(1)
    with pytest.raises(MetadataError, match=r"group 'w1'.*hash.*expected a value hash"):
        metadata.loads(text.replace(f'"hash":"{name}"', f'"hash":"{bad}"', 1), file="m.safetensors")


def test_a_binding_to_a_blake3_name_is_a_portable_file_name(tmp_path, store):
    oid, name = "ab" * 32, "blake3:" + "cd" * 32
    store.bind(oid, name)
    assert store.bound(oid, name) and not store.bound(oid, "cd" * 32)
    files = [p.name for p in (store.objects_dir.parent / "theta-verified").rglob("*") if p.is_file()]
    assert files == [f"{oid}-blake3-{'cd' * 32}"]


def test_a_merge_reads_values_only_for_both_sided_changes_across_name_forms(tmp_path, store):
    """plan_merge compares names; only a group changed on both sides by name, where two names are in different
    forms, is read (value_equal: the BLAKE3-named value hashed in sha256), and then decided by value."""
    from theta.merges.plan import plan_merge, value_equal

    arrays = model()
    p = tmp_path / "m.safetensors"
    save(p, arrays)
    base = as_named_by_sha256(clean_checkpoint(p, store), arrays)
    # ours: w0 changed and put back (named anew), w1 changed; theirs: w0 changed, ids changed
    w0_new, w1_new = arrays["w0"] + 1, arrays["w1"] * 2
    save(p, dict(arrays, w0=w0_new))
    step = clean_checkpoint(p, store, base)
    save(p, dict(arrays, w1=w1_new))
    ours = clean_checkpoint(p, store, step)
    save(p, dict(arrays, w0=w0_new, ids=arrays["ids"] + 1))
    theirs = clean_checkpoint(p, store, base)
    assert ours.groups["w0"].hash == b3(arrays["w0"]) != base.groups["w0"].hash == sha(arrays["w0"])
    asked = []

    def same(x, y):
        asked.append((x.hash, y.hash))
        return value_equal(x, y, store, "m.safetensors", lambda refs: None)

    plan = plan_merge(base, ours, theirs, "m.safetensors", same_value=same)
    assert not plan.conflicts and not plan.pending
    assert plan.kept["w0"] is theirs.groups["w0"] and plan.kept["w1"] is ours.groups["w1"]
    assert plan.kept["ids"] is theirs.groups["ids"]
    # w0 alone was read: ours against theirs (both BLAKE3: not asked), base against ours (asked: the same value)
    assert asked == [(base.groups["w0"].hash, ours.groups["w0"].hash)]
    # names alone: w0 changed on both sides
    assert [x.name for x in plan_merge(base, ours, theirs, "m.safetensors").pending] == ["w0"]
    # value_equal: a value and another one, across forms; the same one; another shape
    assert value_equal(base.groups["w1"], ours.groups["w1"], store, "m", lambda r: None) is False
    assert value_equal(ours.groups["w0"], base.groups["w0"], store, "m", lambda r: None) is True
    assert value_equal(base.groups["w0"], base.groups["w1"], store, "m", lambda r: None) is False
