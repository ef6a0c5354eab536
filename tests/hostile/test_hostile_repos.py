"""Crafted repositories, cloned and checked out with theta installed, under a time limit and a memory cap.

Each repository is written by an attacker with git plumbing (tests/support/crafted.py): the metadata is
whatever bytes the attacker chose. A clone must end quickly, within memory, with an error naming the
file, the group and the field (or a correct checkout), never read outside the LFS store, never leave
temp files, and `git status` in the clone must work afterwards.
"""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from support.crafted import (Attacker, group_line, leftovers, limited_git, meta_text, outside_store_reads, step,
                             value_hash, victim_clone)
from support.gitrepo import GitEnv


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def _clone_refused(genv, evil, *fragments, name="clone"):
    """Clone the attacker's repository; the checkout of model.pt must fail fast with every fragment in its
    error; afterwards `git status` works and nothing is left behind."""
    res, clone = victim_clone(genv, evil.url, name)
    assert not res.timed_out, f"clone took over the limit: {res.err[-2000:]}"
    assert not res.oom_killed, f"clone hit the memory cap (peak {res.peak_bytes})"
    assert res.returncode != 0, res.err
    for fragment in fragments:
        assert fragment in res.err, f"{fragment!r} not in:\n{res.err[-3000:]}"
    assert "Traceback" not in res.err
    target = clone / "model.pt"  # under the real name: nothing, or the placeholder (the metadata text git holds,
    if target.exists():          # named on stderr with a non-zero exit), never refused content
        committed = subprocess.run(["git", "-C", str(clone.path), "cat-file", "blob", "HEAD:model.pt"],
                                   capture_output=True, check=True).stdout
        assert target.read_bytes() == committed and "model.pt is a placeholder" in res.err
    status = limited_git(clone, "status", "--porcelain")
    assert status.returncode == 0, status.err
    assert outside_store_reads(clone) == [] and leftovers(clone) == []
    return res, clone


@pytest.mark.parametrize("oid", ["../../../../../../etc/hostname", "/etc/hostname", "A" * 64, "a" * 63,
                                 "0" * 63 + "/", "%2e%2e/secret"])
def test_oid_outside_the_store_is_refused_before_any_read(genv, oid):
    evil = Attacker.create(genv)
    arr = np.arange(4, dtype=np.float32)
    size = os.path.getsize("/etc/hostname") if os.path.exists("/etc/hostname") else 16
    g = group_line("w", "float32", [4], [step("dense", {"oid": oid, "size": size}, value_hash(arr))])
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    res, _ = _clone_refused(genv, evil, "model.pt", "group 'w'", "steps[0].oid", "64 lowercase hex")
    hostname = open("/etc/hostname", "rb").read() if os.path.exists("/etc/hostname") else b"\0" * 8
    assert hostname[:4] not in res.stderr or len(hostname.strip()) < 4  # nothing of the file is echoed


def test_ten_thousand_dense_steps_of_one_zero_blob_are_refused_fast(genv):
    """The issue's measurement: 10,000 dense steps of one 3 KB blob decoding to 64 MiB of zeros."""
    evil = Attacker.create(genv)
    zeros = np.zeros(16 << 20, dtype=np.float32)  # 64 MiB
    ref = evil.blob({"values": zeros})
    assert ref.size < 8 << 10
    h = value_hash(zeros)
    g = group_line("w", "float32", [16 << 20], [step("dense", ref, h)] * 10_000)
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    res, _ = _clone_refused(genv, evil, "model.pt", "group 'w'", "steps", "exceeds the limit of 64")
    assert res.seconds < 30  # a hang guard: the 60 s limit is the real test


def test_chain_restarting_with_a_second_dense_step_is_refused(genv):
    """dense -> delta -> dense: a chain never restarts (and 2 of them would double the work)."""
    evil = Attacker.create(genv)
    a = np.arange(8, dtype=np.float32)
    dense_ref = evil.blob({"values": a})
    delta_ref = evil.blob({"planes": np.zeros((4, 8), np.uint8)})
    h = value_hash(a)
    g = group_line("w", "float32", [8], [step("dense", dense_ref, h), step("delta", delta_ref, h, {"op": "xor"}),
                                         step("dense", dense_ref, h)])
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "group 'w'", "step 2", "self-contained but not first")


@pytest.mark.slow
def test_a_hundred_thousand_huge_groups_are_refused_before_any_work(genv):
    """100,000 groups of 64 MiB of zeros from one 3 KB blob: 6.4 TB declared, 40 MB of metadata."""
    evil = Attacker.create(genv)
    zeros = np.zeros(16 << 20, dtype=np.float32)
    ref = evil.blob({"values": zeros})
    h = value_hash(zeros)
    st = step("dense", ref, h)
    groups = [group_line(f"g{i:06d}", "float32", [16 << 20], [st]) for i in range(100_000)]
    evil.commit({"model.pt": meta_text(groups)})
    evil.push()
    res, _ = _clone_refused(genv, evil, "model.pt", "over the limit of 1099511627776 bytes")
    assert res.peak_bytes is None or res.peak_bytes < 900 << 20


@pytest.mark.parametrize("mutate,fragments", [
    (lambda g: g.update(shape=[-3, 4]), ["field 'shape'", "out of range"]),
    (lambda g: g.update(shape=[10 ** 30]), ["field 'shape'", "out of range"]),
    (lambda g: g.update(shape=[1 << 40, 1 << 40]), ["field 'shape'", "exceeds"]),
    (lambda g: g.update(dtype="float33"), ["field 'dtype'", "unknown dtype 'float33'"]),
    (lambda g: g["steps"][0].update(type="os:system"), ["steps[0].type", "update type name"]),
    (lambda g: g["steps"][0].update(size=-1), ["steps[0].size", "out of range"]),
    (lambda g: g.update(hash="f" * 64), ["steps[-1].hash", "differs from the group's hash"]),
    (lambda g: g["steps"][0].update(params={"a": [[[[[[[[[[1]]]]]]]]]]}), ["steps[0].params", "nested deeper"]),
], ids=["negative-shape", "huge-dim", "huge-bytes", "dtype", "step-type-syntax", "size", "hash", "params-depth"])
def test_malformed_fields_are_named(genv, mutate, fragments):
    evil = Attacker.create(genv)
    g = evil.dense("layer.w", np.arange(12, dtype=np.float32).reshape(3, 4))
    mutate(g)
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "group 'layer.w'", *fragments)


def test_unknown_step_type_is_named(genv):
    evil = Attacker.create(genv)
    g = evil.dense("w", np.arange(4, dtype=np.float32))
    a = np.arange(4, dtype=np.float32)
    g["steps"].append(step("evil", evil.blob({"x": a}), value_hash(a)))
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "group 'w'", "step 1", "unknown update type 'evil'")


def test_json_nested_a_hundred_thousand_deep_is_refused_without_recursion(genv):
    evil = Attacker.create(genv)
    g = evil.dense("w", np.arange(4, dtype=np.float32))
    text = meta_text([g]).replace('{"structure":null}', '{"structure":' + "[" * 100_000 + "]" * 100_000 + "}")
    evil.commit({"model.pt": text})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "line 3", "nested 100001 levels deep")


def test_group_hash_disagreeing_with_its_blob_is_caught_at_checkout_not_by_status(genv):
    """Under the default theta.verify=frames: the blob is a valid theta blob of another value."""
    evil = Attacker.create(genv)
    real = np.arange(16, dtype=np.float32)
    claimed = value_hash(real + 1)
    ref = evil.blob({"values": real})
    g = group_line("w", "float32", [16], [step("dense", ref, claimed)])
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "group 'w'", ref.oid, "does not match its content hash")


@pytest.mark.parametrize("positions", [2, pytest.param(16, marks=pytest.mark.slow)])
def test_a_flipped_byte_in_a_stored_blob_names_file_group_and_oid(genv, positions):
    evil = Attacker.create(genv)
    g = evil.dense("w", np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    evil.commit({"model.pt": meta_text([g])})
    evil.push()
    res, clone = victim_clone(genv, evil.url, "clone")
    assert res.returncode == 0, res.err
    oid = g["steps"][0]["oid"]
    obj = clone.lfs_object(oid)
    data = bytearray(obj.read_bytes())
    for i in range(0, len(data), max(1, len(data) // positions)):  # each position on its own, same size
        flipped = bytearray(data)
        flipped[i] ^= 0x40
        obj.write_bytes(flipped)
        (clone / "model.pt").unlink(missing_ok=True)
        out = limited_git(clone, "checkout", "--", "model.pt")
        assert out.returncode != 0, f"byte {i}: {out.err}"
        assert "model.pt" in out.err and "'w'" in out.err and oid in out.err, f"byte {i}: {out.err}"
        assert "Traceback" not in out.err and not (clone / "model.pt").exists()
    obj.write_bytes(bytes(data))
    assert limited_git(clone, "checkout", "--", "model.pt").returncode == 0


@pytest.mark.slow
def test_file_metadata_over_what_zipslice_reads_back_is_refused(genv):
    """A file-level metadata string the torch reader would refuse (64 MiB record cap): refused at checkout,
    so `git status` in the clone never meets a file it cannot clean."""
    evil = Attacker.create(genv)
    g = evil.dense("w", np.arange(4, dtype=np.float32))
    evil.commit({"model.pt": meta_text([g], file_meta={"big": "x" * (65 << 20)})})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "field 'metadata'", "zipslice reads back")


def test_structure_with_a_forbidden_torch_global_is_refused(genv):
    evil = Attacker.create(genv)
    g = evil.dense("w", np.arange(4, dtype=np.float32))
    structure = {"dict": [["w", {"tensor": "w"}], ["f", {"torch": "dtype", "value": "load"}]]}
    evil.commit({"model.pt": meta_text([g], structure=structure)})
    evil.push()
    _clone_refused(genv, evil, "model.pt", "structure/f", "unknown dtype 'load'")


def test_a_valid_crafted_repository_checks_out_and_stays_clean(genv):
    """The control: the same plumbing with honest metadata gives a checkout equal bit for bit and a clean
    `git status` (so the refusals above are about the faults, not the method)."""
    import torch

    evil = Attacker.create(genv)
    a = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    b = np.arange(7, dtype=np.int64)
    groups = [evil.dense("a", a), evil.dense("b", b)]
    structure = {"dict": [["a", {"tensor": "a"}], ["b", {"tensor": "b"}], ["epoch", {"value": 3}]]}
    evil.commit({"model.pt": meta_text(groups, structure=structure)})
    evil.push()
    res, clone = victim_clone(genv, evil.url, "clone")
    assert res.returncode == 0, res.err
    got = torch.load(clone / "model.pt", weights_only=True)
    assert np.array_equal(got["a"].numpy(), a) and np.array_equal(got["b"].numpy(), b) and got["epoch"] == 3
    status = limited_git(clone, "status", "--porcelain")
    assert status.returncode == 0 and status.stdout == b"", status.err
    assert leftovers(clone) == []
