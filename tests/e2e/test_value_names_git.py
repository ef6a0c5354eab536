"""A repository committed by a theta that named values by sha256 (fixtures/theta_sha256, made by
make_fixtures.py with theta at 5e4ec7c), used with this theta, which names values it hashes anew by BLAKE3
(theta.base.valuehash): through real git and git-lfs, every version checks out bit for bit, an unchanged
checkpoint keeps its committed text (git status clean), a change names only the changed groups anew
(metadata version 3), and fsck, diff and a merge work across both forms."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zipslice
from support.gitrepo import Repo, clone_bundle

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "theta_sha256"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
VALUES = dict(np.load(FIXTURE / "values.npz"))
SHA256_NAME = re.compile(r"[0-9a-f]{64}")
BLAKE3_NAME = re.compile(r"blake3:[0-9a-f]{64}")


def values_of(commit: str) -> dict[str, np.ndarray]:
    return {k.split("/", 1)[1]: v for k, v in VALUES.items() if k.startswith(commit + "/")}


def checked_out(path: Path) -> dict[str, np.ndarray]:
    with zipslice.load(path) as ck:
        return {k: np.array(ck.numpy(k)) for k in ck.keys()}


def assert_bits(path: Path, want: dict[str, np.ndarray]) -> None:
    got = checked_out(path)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


def names(text: bytes) -> dict[str, dict]:
    """Each group line of a metadata text: its value name and its steps' names."""
    lines = [json.loads(line) for line in text.decode().splitlines()[1:] if line.startswith('{"dtype"')]
    return {g["group"]: {"hash": g["hash"], "steps": [s["hash"] for s in g["steps"]]} for g in lines}


def save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    torch.save({k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, path)


@pytest.fixture()
def clone(tmp_path) -> Repo:
    return clone_bundle(tmp_path, FIXTURE)


def test_the_fixture_names_values_by_sha256(clone):
    for commit in ("C1", "C2"):
        text = clone.show(f"{EXPECTED['commits'][commit]}:model.pt")
        assert text.startswith(b"theta-metadata 1\n")
        for g in names(text).values():
            assert SHA256_NAME.fullmatch(g["hash"]) and all(SHA256_NAME.fullmatch(h) for h in g["steps"])


def test_every_version_checks_out_bit_for_bit_and_status_is_clean(clone):
    assert_bits(clone / "model.pt", values_of("C2"))
    assert clone.status() == ""
    clone.git("checkout", "-q", EXPECTED["commits"]["C1"])
    assert_bits(clone / "model.pt", values_of("C1"))
    assert clone.status() == ""
    # checked against their sha256 names (the bindings this store made were for the older theta's names)
    fsck = clone.theta("fsck", "--json", "HEAD", "main")
    assert json.loads(fsck.stdout)["ok"] is True


def test_an_unchanged_checkpoint_keeps_its_committed_text(clone):
    committed = clone.show("HEAD:model.pt")
    save(clone / "model.pt", values_of("C2"))  # rewritten by torch: new bytes on disk, the same values
    clone.git("add", "model.pt")
    assert clone.show(":model.pt") == committed
    assert clone.status() == ""


def test_a_change_names_only_the_changed_groups_anew(clone):
    before = clone.show("HEAD:model.pt")
    clone.git("config", "theta.keyframeRatio", "inf")  # a step on the sha256-named value, however small the group
    c3 = dict(values_of("C2"), w0=values_of("C2")["w0"] * np.float32(1.01))
    save(clone / "model.pt", c3)
    clone.commit("C3", "model.pt")
    after = clone.show("HEAD:model.pt")
    assert after.startswith(b"theta-metadata 3\n")
    old, new = names(before), names(after)
    assert BLAKE3_NAME.fullmatch(new["w0"]["hash"]) and new["w0"]["hash"] == new["w0"]["steps"][-1]
    assert new["w0"]["steps"][0] == old["w0"]["steps"][0]  # the delta builds on the dense step named by sha256
    for g in ("w1", "b", "ids"):
        assert new[g] == old[g]
    # every line but w0's and the version is the older theta's text
    strip = [line for line in after.splitlines()[1:] if b'"group":"w0"' not in line]
    assert strip == [line for line in before.splitlines()[1:] if b'"group":"w0"' not in line]
    for commit, want in ((EXPECTED["commits"]["C2"], values_of("C2")), (EXPECTED["commits"]["C1"], values_of("C1")),
                         ("main", c3)):
        clone.git("checkout", "-q", commit)
        assert_bits(clone / "model.pt", want)
        assert clone.status() == ""
    assert json.loads(clone.theta("fsck", "--json", "main", "HEAD~1").stdout)["ok"] is True
    diff = json.loads(clone.theta("diff", "--json", "HEAD~1", "HEAD").stdout)
    changed = {g["name"]: g["status"] for f in diff["files"] for g in f["groups"]}
    assert changed == {"w0": "modified"}


def test_the_work_tree_is_compared_with_sha256_names(clone):
    """`git theta diff` of the index against the work tree hashes the file in each committed name's algorithm."""
    c3 = dict(values_of("C2"), b=values_of("C2")["b"] * np.float32(2))
    save(clone / "model.pt", c3)
    diff = json.loads(clone.theta("diff", "--json").stdout)
    changed = {g["name"]: g["status"] for f in diff["files"] for g in f["groups"]}
    assert changed == {"b": "modified"}


def test_a_merge_of_both_forms(clone):
    """Branches that change other groups, one committed by the older theta (sha256 names), merged with
    the merge driver: the result holds each side's change, bit for bit."""
    clone.git("checkout", "-q", "-b", "side", EXPECTED["commits"]["C1"])
    side = dict(values_of("C1"), ids=values_of("C1")["ids"] + 1)
    save(clone / "model.pt", side)
    clone.commit("side: ids", "model.pt")
    clone.git("checkout", "-q", "main")
    clone.git("merge", "-q", "--no-edit", "side")
    want = dict(values_of("C2"), ids=side["ids"])
    assert_bits(clone / "model.pt", want)
    assert clone.status() == ""
    merged = names(clone.show("HEAD:model.pt"))
    assert BLAKE3_NAME.fullmatch(merged["ids"]["hash"]) and SHA256_NAME.fullmatch(merged["w1"]["hash"])


def textconv_names(diff: bytes) -> dict[str, str]:
    """``{"-b": "sha256:ecf40d01f93096cd", " w0": ...}``: each group line of a textconv diff (its side, its name)."""
    out = {}
    for line in diff.decode().splitlines():
        m = re.fullmatch(r"([ +-])(\w+)  \w+ \[[\d, ]*\]  ((?:sha256|blake3):[0-9a-f]{16})", line)
        if m:
            out[m[1] + m[2]] = m[3]
    return out


def label(name: str) -> str:
    return (name if name.startswith("blake3:") else "sha256:" + name)[:23]


@pytest.mark.parametrize("above", ["1MiB", "100"], ids=["smudged-size", "placeholder-size"])
def test_textconv_names_the_work_tree_as_add_would(clone, above):
    """`git diff --no-ext-diff` runs theta's textconv on the index's version and on the work-tree file: the
    unchanged groups read as the same sha256 names on both sides (context lines), the changed one as the
    BLAKE3 name `git add` then records, whether the index's version is small enough to be smudged or not."""
    old = names(clone.show(":model.pt"))
    save(clone / "model.pt", dict(values_of("C2"), b=values_of("C2")["b"] * np.float32(2)))
    got = textconv_names(clone.git("-c", f"theta.materializeAbove={above}", "diff", "--no-ext-diff").stdout)
    clone.git("add", "model.pt")
    new = names(clone.show(":model.pt"))
    assert BLAKE3_NAME.fullmatch(new["b"]["hash"])
    assert got == {" w0": label(old["w0"]["hash"]), " w1": label(old["w1"]["hash"]),
                   " ids": label(old["ids"]["hash"]), "-b": label(old["b"]["hash"]), "+b": label(new["b"]["hash"])}
    assert got[" w0"].startswith("sha256:")
    # index against HEAD: both sides are committed texts, shown as recorded
    cached = textconv_names(clone.git("diff", "--no-ext-diff", "--cached").stdout)
    assert cached == got


def test_textconv_of_history_shows_recorded_names(clone):
    """`git log -p` (textconv on two committed versions) shows the names the texts record: no checkpoint
    is rebuilt for it, so a sha256-era history reads as it was committed."""
    c1, c2 = (names(clone.show(f"{EXPECTED['commits'][c]}:model.pt")) for c in ("C1", "C2"))
    got = textconv_names(clone.git("log", "-p", "--no-ext-diff", "-1", "--format=").stdout)
    want = {}
    for g in c2:
        if c1[g]["hash"] == c2[g]["hash"]:
            want[" " + g] = label(c2[g]["hash"])
        else:
            want["-" + g], want["+" + g] = label(c1[g]["hash"]), label(c2[g]["hash"])
    assert got == want and any(k.startswith("+") for k in got)


def test_a_users_external_diff_gets_the_checkpoint(clone, tmp_path):
    """A user's own GIT_EXTERNAL_DIFF gets the committed checkpoint itself, not the metadata text theta's own
    driver reads. (git calls it only for paths whose diff attribute names no driver with a command: with
    `diff=theta`, theta's driver wins, as any attribute's driver does.)"""
    copy = tmp_path / "old.pt"
    script = tmp_path / "extdiff.py"
    script.write_text(f"import shutil, sys\nshutil.copyfile(sys.argv[2], {str(copy)!r})\n")
    wrapper = tmp_path / "extdiff"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    (clone.git_common_dir() / "info" / "attributes").write_text("model.pt diff=mine\n")
    save(clone / "model.pt", dict(values_of("C2"), b=values_of("C2")["b"] + 1))
    clone.git("diff", extra_env={"GIT_EXTERNAL_DIFF": str(wrapper)})
    assert_bits(copy, values_of("C2"))


def test_a_value_that_went_back_is_unchanged_in_a_merge_and_a_diff(clone):
    """main changes b and puts it back: b is then named anew by BLAKE3, where the merge base names the same
    value by sha256. side changes b. The merge reads main's b, finds the base's value and takes side's b
    (comparing names alone, b changed on both sides: a conflict); a diff of the base and main shows b unchanged."""
    c2 = values_of("C2")
    base = clone.out("rev-parse", "HEAD")
    clone.git("checkout", "-q", "-b", "side")
    side = dict(c2, b=c2["b"] + np.float32(3))
    save(clone / "model.pt", side)
    clone.commit("side: b", "model.pt")
    clone.git("checkout", "-q", "main")
    save(clone / "model.pt", dict(c2, b=c2["b"] * np.float32(2), w0=c2["w0"] + np.float32(1)))
    clone.commit("main: b and w0", "model.pt")
    save(clone / "model.pt", dict(c2, w0=c2["w0"] + np.float32(1)))
    clone.commit("main: b back", "model.pt")
    b_base, b_main = names(clone.show(f"{base}:model.pt"))["b"]["hash"], names(clone.show("HEAD:model.pt"))["b"]["hash"]
    assert SHA256_NAME.fullmatch(b_base) and BLAKE3_NAME.fullmatch(b_main)
    diff = json.loads(clone.theta("diff", "--json", base, "HEAD").stdout)
    assert {g["name"]: g["status"] for f in diff["files"] for g in f["groups"]} == {"w0": "modified"}
    clone.git("merge", "-q", "--no-edit", "side")
    assert_bits(clone / "model.pt", dict(side, w0=c2["w0"] + np.float32(1)))
    assert clone.status() == ""


def test_one_value_named_by_each_hash_on_two_sides_merges(clone):
    """C2 (committed by the older theta) changed b and w1 from C1. A branch from C1 sets b to C2's b with this
    theta (a BLAKE3 name). Merging C2's branch: b is the same value on both sides, w1 comes from C2."""
    c1, c2 = values_of("C1"), values_of("C2")
    clone.git("checkout", "-q", "-b", "mine", EXPECTED["commits"]["C1"])
    save(clone / "model.pt", dict(c1, b=c2["b"]))
    clone.commit("mine: C2's b", "model.pt")
    assert BLAKE3_NAME.fullmatch(names(clone.show("HEAD:model.pt"))["b"]["hash"])
    clone.git("merge", "-q", "--no-edit", "main")
    assert_bits(clone / "model.pt", c2)
    assert clone.status() == ""
