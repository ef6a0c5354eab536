"""The theta merge driver: first on metadata files directly, then through real `git merge` with git-lfs."""
from __future__ import annotations

import io
import subprocess

import ml_dtypes
import numpy as np
import pytest

from theta import lsh
from theta.merge_driver import dense_group, merge_files
from theta.merges import MergeConflict, get as get_strategy
from theta.merges.config import MergeConfig
from theta.metadata import CheckpointMeta, GroupMeta, dumps, loads
from theta.store import LfsStore
from theta.updates import reconstruct
from zipslice import dtypes

F32 = np.float32


# ---------- the driver on metadata files (a real git repo for the LFS store, no `git merge`) -----------------

@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for key in ("GIT_THETA_MERGE_STRATEGY", "GIT_THETA_MERGE_DENSITY", "GIT_THETA_MERGE_ALPHA"):
        monkeypatch.delenv(key, raising=False)
    r = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(r)], check=True)
    return r


def make_meta(store: LfsStore, arrays: dict[str, np.ndarray]) -> CheckpointMeta:
    groups = {}
    for name, arr in arrays.items():
        like = GroupMeta(name=name, dtype=dtypes.from_numpy(arr.dtype).name, shape=arr.shape, hash="", steps=[])
        groups[name] = dense_group(like, arr, store)
    return CheckpointMeta(format="safetensors", order=list(arrays), groups=groups, structure=None, lsh=dict(lsh.PARAMS))


def run_driver(repo, store, o, a, b, config: MergeConfig | None = None, stdin=None):
    files = []
    for role, arrays in (("O", o), ("A", a), ("B", b)):
        f = repo / f".merge_{role}"
        f.write_text(dumps(make_meta(store, arrays)) if arrays is not None else "")
        files.append(f)
    err = io.StringIO()
    before = files[1].read_bytes()
    try:
        meta = merge_files(*map(str, files), "model.safetensors", repo_dir=repo,
                           config=config or MergeConfig(), stdin=stdin, err=err)
    except MergeConflict:
        assert files[1].read_bytes() == before, "%A must stay untouched on conflict"
        raise
    assert loads(files[1].read_text()).groups.keys() == meta.groups.keys()
    return meta, err.getvalue()


def values(meta: CheckpointMeta, store: LfsStore) -> dict[str, np.ndarray]:
    return {n: reconstruct(g, store) for n, g in meta.groups.items()}


def rnd(seed, shape=(32, 48), dtype=F32):
    return np.random.default_rng(seed).normal(0, 0.02, shape).astype(dtype)


def test_disjoint_changes_merge_without_reading_data(repo):
    store = LfsStore.for_repo(repo)
    o = {"a": rnd(0), "b": rnd(1), "c": rnd(2), "gone": rnd(3)}
    a = dict(o, a=rnd(10), new_ours=rnd(11))
    del a["gone"]
    b = dict(o, b=rnd(20), new_theirs=rnd(21, dtype=ml_dtypes.bfloat16))
    del b["gone"]
    meta, log = run_driver(repo, store, o, a, b)
    got = values(meta, store)
    assert sorted(got) == ["a", "b", "c", "new_ours", "new_theirs"]
    for name, want in [("a", a["a"]), ("b", b["b"]), ("c", o["c"]), ("new_ours", a["new_ours"]),
                       ("new_theirs", b["new_theirs"])]:
        assert got[name].tobytes() == want.tobytes() and got[name].dtype == want.dtype
    assert meta.order == ["a", "b", "c", "new_ours", "new_theirs"]
    assert "0 merged by strategy" in log


@pytest.mark.parametrize("strategy", ["average", "ties", "task-arithmetic", "dare", "slerp", "ours", "theirs"])
def test_both_changed_uses_configured_strategy(repo, strategy):
    store = LfsStore.for_repo(repo)
    o = {"w": rnd(0), "keep": rnd(1)}
    a, b = {"w": rnd(5), "keep": o["keep"]}, {"w": rnd(6), "keep": o["keep"]}
    cfg = MergeConfig(git_strategy=strategy, git_params={"density": 0.5, "alpha": 0.3})
    meta, log = run_driver(repo, store, o, a, b, cfg)
    params = {k: v for k, v in {"density": 0.5, "alpha": 0.3}.items() if k in get_strategy(strategy).defaults}
    want = get_strategy(strategy).merge("w", a["w"], b["w"], o["w"], **params)
    got = reconstruct(meta.groups["w"], store)
    assert got.tobytes() == want.tobytes()
    assert meta.groups["keep"] == make_meta(store, {"keep": o["keep"]}).groups["keep"]
    assert f"w: {strategy}" in log and "1 merged by strategy" in log


def test_per_group_rules(repo):
    store = LfsStore.for_repo(repo)
    (repo / ".thetamerge").write_text('[default]\nstrategy = "average"\n[[rule]]\ngroups = "emb*"\nstrategy = "ours"\n')
    o = {"emb": rnd(0), "w": rnd(1)}
    a, b = {"emb": rnd(2), "w": rnd(3)}, {"emb": rnd(4), "w": rnd(5)}
    meta, _ = run_driver(repo, store, o, a, b, MergeConfig.load(repo, environ={}))
    got = values(meta, store)
    assert got["emb"].tobytes() == a["emb"].tobytes()
    np.testing.assert_array_equal(got["w"], (a["w"] * F32(0.5) + b["w"] * F32(0.5)))


def test_shape_conflict_and_delete_modify_are_never_merged(repo):
    store = LfsStore.for_repo(repo)
    o = {"w": rnd(0), "x": rnd(1), "y": rnd(2)}
    a = {"w": rnd(3, (16, 48)), "x": rnd(4), "y": rnd(5)}
    b = {"w": rnd(6), "y": rnd(7)}
    with pytest.raises(MergeConflict) as e:
        run_driver(repo, store, o, a, b, MergeConfig(git_strategy="average"))
    msg = str(e.value)
    assert "w: ours is float32[16, 48] but theirs is float32[32, 48]" in msg
    assert "x: deleted on theirs but modified on ours" in msg
    assert "y:" not in msg  # y is mergeable; it does not block or appear


def test_no_strategy_and_no_terminal_gives_a_clear_message(repo):
    store = LfsStore.for_repo(repo)
    o = {"w": rnd(0)}
    with pytest.raises(MergeConflict, match="no merge strategy is configured.*git config theta.merge.strategy"):
        run_driver(repo, store, o, {"w": rnd(1)}, {"w": rnd(2)}, stdin=io.StringIO("1\n"))


def test_strategy_that_does_not_apply_is_a_conflict(repo):
    store = LfsStore.for_repo(repo)
    a, b = {"w": rnd(1)}, {"w": rnd(2)}
    with pytest.raises(MergeConflict, match="'ties'.*no common ancestor.*applicable: ours, theirs, average, slerp"):
        run_driver(repo, store, None, a, b, MergeConfig(git_strategy="ties"))
    ints = {"n": np.arange(5)}
    with pytest.raises(MergeConflict, match="'average'.*the group is int64"):
        run_driver(repo, store, ints, {"n": np.arange(5) + 1}, {"n": np.arange(5) + 2}, MergeConfig(git_strategy="average"))
