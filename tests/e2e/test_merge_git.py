"""The theta merge driver: first on metadata files directly, then through real `git merge` with git-lfs."""
from __future__ import annotations

import io
import subprocess

import ml_dtypes
import numpy as np
import pytest

from theta.base import lsh
from theta.commands.merge_driver import merge_files
from theta.updates.steps import dense_group
from theta.base.errors import MergeConflict
from theta.merges import get as get_strategy
from theta.settings.merge_rules import MergeConfig
from theta.storage.metadata import CheckpointMeta, GroupMeta, dumps, loads
from theta.storage.store import LfsStore
from theta.updates.rebuild import reconstruct
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
    assert "y: " not in msg.replace("automatically: ", "")  # y is mergeable: it does not block or appear
    assert "(file)" not in msg


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


# ---------- through real `git merge` / rebase / cherry-pick with git-lfs ---------------------------------------

from collections import OrderedDict

import torch

from support.gitrepo import GitEnv  # noqa: E402


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    sd["embed.weight"] = torch.randn(40, 16, generator=g) * 0.02
    for i in range(3):
        sd[f"layers.{i}.weight"] = torch.randn(24, 16, generator=g) * 0.02
        sd[f"layers.{i}.bias"] = torch.zeros(24)
    sd["head.weight"] = (torch.randn(16, 40, generator=g) * 0.02).to(torch.bfloat16)
    sd["step"] = torch.tensor(3)
    return sd


def changed(sd, seed, *names, shape=None):
    g = torch.Generator().manual_seed(seed)
    out = OrderedDict(sd)
    for n in names:
        t = sd[n]
        out[n] = (t.float() + torch.randn(shape or t.shape, generator=g) * 0.01).to(t.dtype)
    return out


def np_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def load_sd(path) -> OrderedDict:
    return torch.load(path, weights_only=True)


def assert_sd_equal(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert np_of(got[k]).tobytes() == np_of(want[k]).tobytes(), k


@pytest.fixture
def grepo(tmp_path):
    env = GitEnv.create(tmp_path)
    r = env.init("work")
    torch.save(state(0), r / "model.pt")
    r.commit("base", ".gitattributes", "model.pt")
    return r


def branches(r, ours_sd, theirs_sd):
    """Branch 'other' gets theirs_sd, main gets ours_sd; both committed; main checked out."""
    r.git("checkout", "-q", "-b", "other")
    torch.save(theirs_sd, r / "model.pt")
    r.commit("theirs", "model.pt")
    r.git("checkout", "-q", "main")
    torch.save(ours_sd, r / "model.pt")
    r.commit("ours", "model.pt")


def merge(r, *args, env=None):
    return r.git("merge", "--no-edit", *args, "other", check=False, extra_env=env)


def test_git_merge_of_different_groups_is_automatic(grepo):
    base = state(0)
    ours = changed(base, 1, "layers.0.weight", "head.weight")
    theirs = changed(base, 2, "layers.2.weight", "embed.weight")
    branches(grepo, ours, theirs)
    proc = merge(grepo)
    assert proc.returncode == 0, proc.stderr.decode()
    want = OrderedDict(ours)
    want["layers.2.weight"], want["embed.weight"] = theirs["layers.2.weight"], theirs["embed.weight"]
    assert_sd_equal(load_sd(grepo / "model.pt"), want)
    assert grepo.status() == ""
    assert grepo.out("log", "-1", "--format=%P").count(" ") == 1  # a merge commit


_QUICK = {("config", "average"), ("env", "ties")}  # the other combinations run with -m slow


@pytest.mark.parametrize("how,strategy,params", [
    pytest.param(how, s, p, marks=() if (how, s) in _QUICK else pytest.mark.slow, id=f"{how}-{s}")
    for how in ("config", "env")
    for s, p in [("average", {"alpha": 0.25}), ("ties", {"density": 0.5}), ("task-arithmetic", {}),
                 ("dare", {"density": 0.5}), ("slerp", {"t": 0.3}), ("theirs", {})]])
def test_git_merge_same_groups_with_strategy(grepo, how, strategy, params):
    base = state(0)
    ours = changed(base, 1, "layers.1.weight", "head.weight", "layers.0.bias")
    theirs = changed(base, 2, "layers.1.weight", "head.weight", "embed.weight")
    branches(grepo, ours, theirs)
    env = None
    if how == "config":
        grepo.git("config", "theta.merge.strategy", strategy)
        for k, v in params.items():
            grepo.git("config", f"theta.merge.{k.replace('_', '-')}", str(v))
    else:
        env = {"GIT_THETA_MERGE_STRATEGY": strategy, **{f"GIT_THETA_MERGE_{k.upper()}": str(v) for k, v in params.items()}}
    proc = merge(grepo, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    got = load_sd(grepo / "model.pt")
    s = get_strategy(strategy)
    for name in ("layers.1.weight", "head.weight"):
        full = f"{name}"
        # groups are named by their flattened path in the checkpoint: a plain state dict has no prefix
        want = s.merge(full, np_of(ours[name]), np_of(theirs[name]), np_of(base[name]), **params)
        assert np_of(got[name]).tobytes() == want.tobytes(), name
    assert np_of(got["layers.0.bias"]).tobytes() == np_of(ours["layers.0.bias"]).tobytes()
    assert np_of(got["embed.weight"]).tobytes() == np_of(theirs["embed.weight"]).tobytes()
    assert f"layers.1.weight: {strategy}" in proc.stderr.decode()
    assert grepo.status() == ""
    # the merge commit checks out bit for bit from the store alone
    (grepo / "model.pt").unlink()
    grepo.git("checkout", "--", "model.pt")
    assert_sd_equal(load_sd(grepo / "model.pt"), got)


def test_git_merge_shape_conflict_stops_cleanly(grepo):
    base = state(0)
    ours = changed(base, 1, "layers.1.weight")
    theirs = OrderedDict(base)
    theirs["layers.1.weight"] = torch.randn(30, 16)
    branches(grepo, ours, theirs)
    grepo.git("config", "theta.merge.strategy", "average")
    proc = merge(grepo)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "layers.1.weight: ours is float32[24, 16] but theirs is float32[30, 16]" in err
    stages = grepo.out("ls-files", "-u", "model.pt").splitlines()
    assert sorted(line.split()[2] for line in stages) == ["1", "2", "3"]
    grepo.git("merge", "--abort")
    assert grepo.status() == ""
    assert_sd_equal(load_sd(grepo / "model.pt"), ours)


def test_git_merge_without_strategy_or_terminal_explains(grepo):
    base = state(0)
    branches(grepo, changed(base, 1, "layers.1.weight"), changed(base, 2, "layers.1.weight"))
    proc = grepo.env.run(["git", "merge", "--no-edit", "other"], cwd=grepo.path, check=False)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "layers.1.weight: changed on both sides; no merge strategy is configured" in err
    assert "git config theta.merge.strategy" in err
    # manual mode: the three versions as real checkpoints
    out = grepo.theta("merge-manual", "model.pt").stdout.decode().split()
    assert out == ["model.ours.pt", "model.theirs.pt", "model.ancestor.pt"]
    assert_sd_equal(load_sd(grepo / "model.theirs.pt"), changed(base, 2, "layers.1.weight"))
    assert_sd_equal(load_sd(grepo / "model.ancestor.pt"), base)
    for role in ("ours", "theirs", "ancestor"):
        (grepo / f"model.{role}.pt").unlink()
    # or resolve the conflict after the fact with a strategy, then commit
    grepo.theta("merge-resolve", "model.pt", "--strategy", "average", "-p", "alpha=0.75")
    grepo.git("commit", "-q", "--no-edit")
    ours, theirs = changed(base, 1, "layers.1.weight"), changed(base, 2, "layers.1.weight")
    want = get_strategy("average").merge("layers.1.weight", np_of(ours["layers.1.weight"]),
                                         np_of(theirs["layers.1.weight"]), None, alpha=0.75)
    got = load_sd(grepo / "model.pt")
    assert np_of(got["layers.1.weight"]).tobytes() == want.tobytes()
    assert grepo.status() == ""
    assert grepo.out("log", "-1", "--format=%P").count(" ") == 1


def test_interactive_menu_in_a_terminal(grepo):
    pexpect = pytest.importorskip("pexpect")
    base = state(0)
    ours = changed(base, 1, "layers.0.weight", "layers.1.weight", "layers.2.weight")
    theirs = changed(base, 2, "layers.0.weight", "layers.1.weight", "layers.2.weight")
    branches(grepo, ours, theirs)
    child = pexpect.spawn("git", ["merge", "--no-edit", "other"], cwd=str(grepo.path), env=grepo.env.env,
                          encoding="utf-8", timeout=60)
    child.expect(r"group 'layers.0.weight' \(float32\[24, 16\]\) changed on both sides")
    child.expect(r"Strategy for 'layers.0.weight' \[1-9 or name\]: ")
    child.sendline("theirs")
    child.expect("Use 'theirs' for all 2 remaining conflicting group\\(s\\) too\\? \\[y/N\\]: ")
    child.sendline("n")
    child.expect(r"Strategy for 'layers.1.weight'")
    child.sendline("4")  # average
    child.expect("for all 1 remaining")
    child.sendline("y")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    got = load_sd(grepo / "model.pt")
    avg = get_strategy("average")
    assert np_of(got["layers.0.weight"]).tobytes() == np_of(theirs["layers.0.weight"]).tobytes()
    for n in ("layers.1.weight", "layers.2.weight"):
        want = avg.merge(n, np_of(ours[n]), np_of(theirs[n]), None)
        assert np_of(got[n]).tobytes() == want.tobytes()
    assert grepo.status() == ""


def test_rebase_and_cherry_pick_of_model_commits(grepo):
    base = state(0)
    theirs = changed(base, 2, "layers.2.weight")
    ours = changed(base, 1, "layers.0.weight")
    branches(grepo, ours, theirs)
    # cherry-pick their commit onto main: 3-way through the merge driver with ancestor = base
    grepo.git("cherry-pick", "other")
    want = OrderedDict(ours)
    want["layers.2.weight"] = theirs["layers.2.weight"]
    assert_sd_equal(load_sd(grepo / "model.pt"), want)
    assert grepo.status() == ""
    # rebase 'other' onto main (its change is already there: the commit becomes empty and is dropped)
    grepo.git("checkout", "-q", "other")
    theirs2 = changed(theirs, 3, "layers.1.bias")
    torch.save(theirs2, grepo / "model.pt")
    grepo.commit("theirs 2", "model.pt")
    grepo.git("rebase", "-q", "main")
    want2 = OrderedDict(want)
    want2["layers.1.bias"] = theirs2["layers.1.bias"]
    assert_sd_equal(load_sd(grepo / "model.pt"), want2)
    assert grepo.status() == ""
    grepo.git("checkout", "-q", "HEAD~1")
    assert_sd_equal(load_sd(grepo / "model.pt"), want)


def test_manual_strategy_leaves_a_conflict(repo):
    store = LfsStore.for_repo(repo)
    o = {"w": rnd(0), "v": rnd(1)}
    cfg = MergeConfig(git_strategy="average", rules=[])
    from theta.settings.merge_rules import Rule

    cfg.rules.append(Rule(groups=("w",), paths=(), strategy="manual", params={}, label="rule"))
    with pytest.raises(MergeConflict, match="w: changed on both sides; left for a manual merge"):
        run_driver(repo, store, o, {"w": rnd(2), "v": rnd(3)}, {"w": rnd(4), "v": rnd(5)}, cfg)


def test_menu_answers():
    from theta.commands.merge_menu import ask

    out = io.StringIO()
    a = ask("m.pt", "w", "float32[2]", ["ours", "theirs", "average"], 3, io.StringIO("9\nbogus\n3\ny\n"), out)
    assert (a.strategy, a.for_all) == ("average", True)
    text = out.getvalue()
    assert "please answer a number from 1 to 4" in text and "4) manual" in text
    a = ask("m.pt", "w", "float32[2]", ["ours"], 0, io.StringIO("ours\n"), io.StringIO())
    assert (a.strategy, a.for_all) == ("ours", False)
    a = ask("m.pt", "w", "float32[2]", ["ours"], 2, io.StringIO(""), io.StringIO())  # end of input
    assert a.strategy == "manual"


def test_structure_values_merge_leaf_by_leaf():
    from theta.merges.plan import merge_structure

    def tree(epoch, name, lr):
        return {"dict": [["model", {"odict": [["w", {"tensor": "model/w"}]], "metadata": {"dict": []}}],
                         ["epoch", {"value": epoch}], ["name", {"value": name}], ["opt", {"list": [{"float": lr}]}]]}

    o, a, b = tree(1, "base", "0x1p-4"), tree(2, "base", "0x1p-4"), tree(1, "tuned", "0x1p-5")
    conflicts: list = []
    assert merge_structure(o, a, b, None, conflicts) == tree(2, "tuned", "0x1p-5") and conflicts == []
    b2 = tree(3, "base", "0x1p-4")
    assert merge_structure(o, a, b2, None, conflicts) is not None
    assert conflicts == ['(value) epoch: changed on both sides ({"value": 2} vs {"value": 3}); choose with '
                         '`git config theta.merge.values ours|theirs` or GIT_THETA_MERGE_VALUES']
    conflicts.clear()
    assert merge_structure(o, a, b2, "theirs", conflicts) == b2 and conflicts == []
    other = {"dict": [["model", {"dict": []}]]}
    merge_structure(o, a, other, "ours", conflicts)
    assert conflicts == ["(file) (root): the checkpoint structure changed on both sides"]


@pytest.mark.slow  # the leaf-by-leaf logic is covered above without git
def test_git_merge_with_epoch_counters(grepo):
    base = state(0)
    ours, theirs = changed(base, 1, "layers.0.weight"), changed(base, 2, "layers.1.weight")
    torch.save({"model": base, "epoch": 3}, grepo / "model.pt")
    grepo.commit("base with an epoch counter", "model.pt")
    grepo.git("checkout", "-q", "-b", "other")
    torch.save({"model": theirs, "epoch": 5}, grepo / "model.pt")
    grepo.commit("theirs", "model.pt")
    grepo.git("checkout", "-q", "main")
    torch.save({"model": ours, "epoch": 4}, grepo / "model.pt")
    grepo.commit("ours", "model.pt")
    proc = merge(grepo)
    assert proc.returncode != 0 and "(value) epoch: changed on both sides" in proc.stderr.decode()
    grepo.git("merge", "--abort")
    proc = merge(grepo, env={"GIT_THETA_MERGE_VALUES": "theirs"})
    assert proc.returncode == 0, proc.stderr.decode()
    got = torch.load(grepo / "model.pt", weights_only=True)
    assert got["epoch"] == 5
    want = OrderedDict(ours)
    want["layers.1.weight"] = theirs["layers.1.weight"]
    assert_sd_equal(got["model"], want)
    assert grepo.status() == ""


@pytest.mark.slow
def test_merge_and_diff_fetch_missing_blobs_from_the_remote(tmp_path):
    genv = GitEnv.create(tmp_path)
    r = genv.init("work")
    bare = genv.init("remote.git", theta=False, bare=True)
    r.git("remote", "add", "origin", f"file://{bare.path}")
    base = state(0)
    torch.save(base, r / "model.pt")
    r.commit("base", ".gitattributes", "model.pt")
    ours, theirs = changed(base, 1, "layers.1.weight"), changed(base, 2, "layers.1.weight")
    branches(r, ours, theirs)
    r.git("push", "-q", "origin", "main", "other")
    genv.run(["git", "theta", "install"], cwd=genv.home)  # global: the clone gets the filter and drivers
    clone = genv.clone(f"file://{bare.path}", "clone")
    assert_sd_equal(load_sd(clone / "model.pt"), ours)
    theirs_oids = {s.blob.oid for s in loads(clone.show("origin/other:model.pt")).groups["layers.1.weight"].steps}
    assert not theirs_oids <= clone.lfs_objects()  # their new blob is not here yet
    text = clone.theta("diff", "main", "origin/other").stdout.decode()
    want_l2 = np.linalg.norm(np_of(theirs["layers.1.weight"]).astype(np.float64)
                             - np_of(ours["layers.1.weight"]).astype(np.float64))
    assert f"modified  layers.1.weight  float32 [24, 16]" in text and f"|Δ|₂ {want_l2:.3e}" in text
    proc = clone.git("merge", "--no-edit", "origin/other", check=False, extra_env={"GIT_THETA_MERGE_STRATEGY": "average"})
    assert proc.returncode == 0, proc.stderr.decode()
    got = load_sd(clone / "model.pt")
    want = get_strategy("average").merge("layers.1.weight", np_of(ours["layers.1.weight"]),
                                          np_of(theirs["layers.1.weight"]), None)
    assert np_of(got["layers.1.weight"]).tobytes() == want.tobytes()
    assert clone.status() == ""
