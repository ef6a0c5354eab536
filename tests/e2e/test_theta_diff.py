"""Model diffs: change statistics, metadata-first comparison, git's external diff, textconv, `git theta diff`."""
from __future__ import annotations

import io
import math
import subprocess
from collections import OrderedDict

import ml_dtypes
import numpy as np
import pytest
import torch

from theta.base import lsh
from theta.commands.diff_driver import make_console, render
from theta.model.diff import MetaSide, change_stats, diff_sides
from theta.updates.steps import dense_group
from theta.storage.metadata import CheckpointMeta, GroupMeta
from theta.storage.store import LfsStore
from zipslice import dtypes

from support.gitrepo import GitEnv  # noqa: E402

F32 = np.float32


# ---------- statistics ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.dtype(F32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64)], ids=str)
def test_change_stats_against_numpy(dtype, monkeypatch):
    import theta.model.diff as ds

    monkeypatch.setattr(ds, "CHUNK", 777)  # several chunks
    rng = np.random.default_rng(0)
    old = rng.normal(0, 1, (50, 40)).astype(dtype)
    new = old.copy()
    new[3] = (new[3].astype(F32) + 0.5).astype(dtype)
    new[7, :5] = 0
    s = change_stats(old, new)
    o64, n64 = old.astype(np.float64), new.astype(np.float64)
    d = n64 - o64
    assert s.numel == 2000
    assert s.changed == int(np.count_nonzero(old.view(f"u{dtype.itemsize}") != new.view(f"u{dtype.itemsize}")))
    assert 40 <= s.changed <= 45
    assert math.isclose(s.l2, np.linalg.norm(d), rel_tol=1e-12)
    assert math.isclose(s.old_l2, np.linalg.norm(o64), rel_tol=1e-12)
    assert s.max_abs == np.abs(d).max()
    assert math.isclose(s.relative, np.linalg.norm(d) / np.linalg.norm(o64), rel_tol=1e-12)
    assert s.fraction == s.changed / 2000


def test_change_stats_edge_cases():
    z = np.zeros(4, F32)
    s = change_stats(z, np.array([0, 0, 0, -0.0], F32))
    assert (s.changed, s.l2, s.relative) == (1, 0.0, 0.0)  # -0.0 differs in bits only
    assert change_stats(z, np.array([0, 1, 0, 0], F32)).relative == math.inf
    s = change_stats(np.arange(6), np.arange(6) * 2)
    assert (s.changed, s.max_abs) == (5, 5.0)
    assert change_stats(np.zeros(0, F32), np.zeros(0, F32)).fraction == 0.0


# ---------- metadata-first comparison ------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    return LfsStore.for_repo(tmp_path / "r")


def meta_of(store, arrays):
    groups = {}
    for name, arr in arrays.items():
        like = GroupMeta(name=name, dtype=dtypes.from_numpy(arr.dtype).name, shape=arr.shape, hash="", steps=[])
        groups[name] = dense_group(like, arr, store)
    return CheckpointMeta(format="safetensors", order=list(arrays), groups=groups, lsh=dict(lsh.PARAMS))


def two_versions(store):
    rng = np.random.default_rng(1)
    old = {"same": rng.normal(0, 1, (64, 64)).astype(F32), "mod": rng.normal(0, 1, (256, 300)).astype(F32),
           "gone": np.ones(3, F32), "shape": np.zeros((4, 4), F32), "kind": np.zeros(4, F32)}
    new = {"same": old["same"], "mod": old["mod"] + F32(0.01), "shape": np.zeros((2, 8), F32),
           "kind": np.zeros(4, np.float64), "fresh": np.arange(5, dtype=np.int32)}
    return old, new, meta_of(store, old), meta_of(store, new)


def test_diff_sides_reads_only_modified_groups(store):
    old, new, mo, mn = two_versions(store)
    # remove the blobs of every group but "mod": comparing must not need them
    for name in ("same", "gone", "shape", "kind"):
        assert store.remove(mo.groups[name].steps[0].blob) > 0
    for name in ("same", "shape", "kind", "fresh"):
        store.remove(mn.groups[name].steps[0].blob)
    fd = diff_sides(MetaSide(mo, "m", store=store), MetaSide(mn, "m", store=store), "m.safetensors")
    status = {g.name: g.status for g in fd.groups}
    assert status == {"mod": "modified", "shape": "reshaped", "kind": "retyped", "fresh": "added", "gone": "removed"}
    assert fd.unchanged == 1
    st = next(g for g in fd.groups if g.name == "mod").stats
    assert st.changed == 256 * 300
    assert math.isclose(st.l2, np.linalg.norm((new["mod"] - old["mod"]).astype(np.float64)), rel_tol=1e-9)

    out = io.StringIO()
    render(fd, make_console(out, color=False))
    text = out.getvalue()
    assert "modified  mod  float32 [256, 300]  update dense" in text
    assert f"|Δ|₂ {st.l2:.3e}" in text and "changed 100.00% (76,800/76,800)" in text
    assert "reshaped  shape  float32 [4, 4] -> float32 [2, 8]" in text
    assert "retyped   kind  float32 [4] -> float64 [4]" in text
    assert "added     fresh  int32 [5]" in text and "removed   gone  float32 [3]" in text
    assert "1 modified, 1 added, 1 removed, 1 reshaped, 1 retyped, 1 unchanged" in text
    assert "\x1b[" not in text  # plain when not a terminal
    out = io.StringIO()
    render(fd, make_console(out, color=True))
    assert "\x1b[" in out.getvalue()


def test_estimate_mode_reads_no_data(store):
    old, new, mo, mn = two_versions(store)
    for ref in set(mo.blob_refs()) | set(mn.blob_refs()):
        store.remove(ref)
    fd = diff_sides(MetaSide(mo, "m", store=store), MetaSide(mn, "m", store=store), "m", estimate=True)
    g = next(g for g in fd.groups if g.name == "mod")
    true = float(np.linalg.norm((new["mod"] - old["mod"]).astype(np.float64)))
    assert g.stats is None and 0.4 * true < g.estimate < 2.5 * true
    out = io.StringIO()
    render(fd, make_console(out, color=False))
    assert "(LSH estimate)" in out.getvalue() and "distances are LSH estimates" in out.getvalue()


# ---------- with git ------------------------------------------------------------------------------------------

@pytest.fixture
def history(tmp_path):
    env = GitEnv.create(tmp_path)
    r = env.init("work")
    g = torch.Generator().manual_seed(0)
    v1 = OrderedDict([("enc.weight", torch.randn(30, 20, generator=g)), ("enc.bias", torch.zeros(30)),
                      ("head", torch.ones(8, dtype=torch.bfloat16))])
    torch.save(v1, r / "model.pt")
    r.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v1)
    v2["enc.weight"] = v1["enc.weight"].clone()
    v2["enc.weight"][2, :4] += 0.25
    del v2["enc.bias"]
    v2["extra"] = torch.arange(6.0)
    torch.save(v2, r / "model.pt")
    return r, v1, v2


def _expected_l2(v1, v2):
    return float(np.linalg.norm((v2["enc.weight"].double() - v1["enc.weight"].double()).numpy()))


def test_git_diff_show_log_and_textconv(history):
    r, v1, v2 = history
    l2 = f"{_expected_l2(v1, v2):.3e}"
    wt = r.git("diff").stdout.decode()           # index metadata vs the working-tree checkpoint
    assert "theta diff model.pt (torch)" in wt
    assert f"modified  enc.weight  float32 [30, 20]  |Δ|₂ {l2}" in wt and "changed 0.67% (4/600)" in wt
    assert "removed   enc.bias  float32 [30]" in wt and "added     extra  float32 [6]" in wt
    r.commit("v2", "model.pt")
    for cmd in (["show", "--ext-diff", "--format=%s"], ["log", "-p", "--ext-diff", "--format=%s"]):
        text = r.git(*cmd).stdout.decode()
        assert f"modified  enc.weight  float32 [30, 20]" in text and f"|Δ|₂ {l2}" in text, cmd
        assert "1 modified, 1 added, 1 removed, 1 unchanged" in text
    # without --ext-diff git log uses textconv, when configured: one line per group
    r.git("config", "diff.theta.textconv", "git-theta diff-textconv")
    text = r.git("show", "--format=%s").stdout.decode()
    assert "-enc.bias  float32 [30]  blake3:" in text and "+extra  float32 [6]  blake3:" in text
    assert " head  bfloat16 [8]  blake3:" in text  # unchanged group: a context line


def test_git_theta_diff_command(history):
    r, v1, v2 = history
    l2 = f"{_expected_l2(v1, v2):.3e}"
    text = r.theta("diff").stdout.decode()  # index vs working tree
    assert f"|Δ|₂ {l2}" in text
    r.commit("v2", "model.pt")
    assert r.theta("diff").stdout.decode() == ""  # nothing changed in the working tree
    text = r.theta("diff", "HEAD~1", "HEAD").stdout.decode()
    assert "update delta" in text or "update dense" in text or "update sparse" in text
    assert f"|Δ|₂ {l2}" in text
    stat = r.theta("diff", "--stat", "HEAD~1", "--", "model.pt").stdout.decode()
    assert stat.startswith("model.pt | 1 modified, 1 added, 1 removed, 1 unchanged")
    est = r.theta("diff", "--estimate", "HEAD~1", "HEAD").stdout.decode()
    assert "LSH estimate" in est and "enc.weight" in est
    assert r.theta("diff", "HEAD~1", "HEAD", "--", "other.pt").stdout.decode() == ""


def test_non_tensor_value_changes_are_noted(store):
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, 10).astype(F32)
    mo, mn = meta_of(store, {"model/w": w}), meta_of(store, {"model/w": w})
    mo.structure = {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}]]}], ["epoch", {"value": 3}]]}
    mn.structure = {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}]]}], ["epoch", {"value": 4}]]}
    fd = diff_sides(MetaSide(mo, "m", store=store), MetaSide(mn, "m", store=store), "m.pt")
    assert fd.notes == ["non-tensor values changed: epoch"] and fd.unchanged == 1
    out = io.StringIO()
    render(fd, make_console(out, color=False))
    assert "note      non-tensor values changed: epoch" in out.getvalue()
