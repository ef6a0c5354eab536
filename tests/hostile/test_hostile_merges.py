"""Merge parameters from every source are checked (finite, in range), a merge that would turn finite values
into NaN/inf stops as a conflict naming the group, and .thetamerge (it comes with the repository) is
bounded in size and nesting: a clear error, never a traceback."""
from __future__ import annotations

import io
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from theta.base import lsh
from theta.commands.merge_driver import merge_files
from theta.base.errors import MergeConflict, MergeError
from theta.settings import merge_rules as merge_settings
from theta.settings.merge_rules import MergeConfig, toml_depth
from theta.storage.metadata import CheckpointMeta, GroupMeta, dumps
from theta.storage.store import LfsStore
from theta.updates.steps import dense_group
from zipslice import dtypes

from support.crafted import limited_git
from support.gitrepo import GitEnv


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    r = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(r)], check=True)
    return r


def _meta(store, arrays) -> CheckpointMeta:
    groups = {}
    for name, arr in arrays.items():
        like = GroupMeta(name=name, dtype=dtypes.from_numpy(arr.dtype).name, shape=arr.shape, hash="", steps=[])
        groups[name] = dense_group(like, arr, store)
    return CheckpointMeta(format="safetensors", order=list(arrays), groups=groups, lsh=dict(lsh.PARAMS))


def _merge(repo, config: MergeConfig, names=("w", "b")):
    store = LfsStore.for_repo(repo)
    rng = np.random.default_rng(0)
    o = {n: rng.standard_normal(64).astype(np.float32) for n in names}
    a = {n: v + 1 for n, v in o.items()}
    b = {n: v - 1 for n, v in o.items()}
    files = []
    for role, arrays in (("O", o), ("A", a), ("B", b)):
        f = repo / f".merge_{role}"
        f.write_text(dumps(_meta(store, arrays)))
        files.append(f)
    before = files[1].read_bytes()
    try:
        return merge_files(*map(str, files), "model.safetensors", repo_dir=repo, config=config, err=io.StringIO())
    except MergeConflict:
        assert files[1].read_bytes() == before, "%A must stay untouched on a conflict"
        raise


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_parameters_are_refused_from_every_source(repo, value, monkeypatch):
    (repo / ".thetamerge").write_text(f'[default]\nstrategy = "average"\nalpha = {value.lower().replace("1e999", "inf")}\n')
    with pytest.raises(MergeError, match=r"\.thetamerge \[default\]: alpha: expected a finite number"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").unlink()
    with pytest.raises(MergeError, match="environment GIT_THETA_MERGE_ALPHA: expected a finite number"):
        MergeConfig.load(repo, environ={"GIT_THETA_MERGE_ALPHA": value})
    subprocess.run(["git", "-C", str(repo), "config", "theta.merge.alpha", value], check=True)
    with pytest.raises(MergeError, match="git config theta.merge.alpha: expected a finite number"):
        MergeConfig.load(repo, environ={})


@pytest.mark.parametrize("strategy,params,fragment", [
    ("ties", {"density": 2.0}, "density must be in (0, 1], got 2.0"),
    ("dare", {"density": 0.0}, "density must be in (0, 1], got 0.0"),
    ("dare", {"seed": 0.5}, "seed must be a whole number"),
    ("slerp", {"t": 1e300}, "t must be in [0, 1], got 1e+300"),
    ("dare", {"seed": 1e30}, "seed must be in [0, 9.0072e+15], got 1e+30"),
])
def test_out_of_range_parameters_are_conflicts_naming_the_group_before_any_read(repo, strategy, params, fragment):
    cfg = MergeConfig(env_strategy=strategy, env_params=params, interactive=False)
    with pytest.raises(MergeConflict) as e:
        _merge(repo, cfg)
    assert any(p.startswith("b: ") and fragment in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("strategy,params", [("average", {"alpha": 1e308}), ("average", {"alpha": -3e38}),
                                             ("task-arithmetic", {"lambda_ours": 1e308, "lambda_theirs": 1e308}),
                                             ("ties", {"lambda": 1e308})])
def test_finite_parameters_that_overflow_are_conflicts_naming_the_group(repo, strategy, params):
    cfg = MergeConfig(env_strategy=strategy, env_params=params, interactive=False)
    with pytest.raises(MergeConflict) as e:
        _merge(repo, cfg)
    assert sorted(p.split(":")[0] for p in e.value.problems) == ["b", "w"]
    assert all("turned finite values into" in p and "NaN/inf" in p for p in e.value.problems)


def test_parameters_that_stay_finite_still_merge(repo):
    meta = _merge(repo, MergeConfig(env_strategy="average", env_params={"alpha": 0.25}, interactive=False))
    assert sorted(meta.groups) == ["b", "w"]


def test_deeply_nested_thetamerge_is_an_error_not_a_recursion(repo):
    (repo / ".thetamerge").write_text("[default]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(MergeError, match=r"nested 100000 deep, over the limit of 8"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").write_text("[default]\nx = " + "{a = " * 5_000 + "1" + "}" * 5_000 + "\n")
    with pytest.raises(MergeError, match="nested 5000 deep"):
        MergeConfig.load(repo, environ={})


def test_huge_thetamerge_and_too_many_rules_are_refused(repo):
    (repo / ".thetamerge").write_text("# " + "x" * merge_settings.MAX_RULES_FILE_BYTES + "\n")
    with pytest.raises(MergeError, match="over the limit of 1048576"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").write_text('[[rule]]\nstrategy = "ours"\n' * (merge_settings.MAX_RULES + 1))
    with pytest.raises(MergeError, match="1001 rules, over the limit of 1000"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").write_text('[[rule]]\ngroups = ["' + "*" * 2000 + '"]\nstrategy = "ours"\n')
    with pytest.raises(MergeError, match="globs of at most 1024 characters"):
        MergeConfig.load(repo, environ={})


def test_toml_depth_skips_strings_and_comments():
    text = ('[default]\nstrategy = "ties" # [[[[[[\n[[rule]]\ngroups = ["*[a]*", \'[[[\']\n'
            'note = """\n[[[[[[[\n"""\nlit = \'\'\'[[[[[[[\'\'\'\nesc = "\\"[[[["\n')
    assert toml_depth(text) == 2


# ---------- through real `git merge` in a repository whose .thetamerge the attacker wrote -------------------------

def _diverged(genv: GitEnv, thetamerge: str):
    repo = genv.init("work", track=("*.safetensors",))
    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal((8, 8)).astype(np.float32)}
    save_file(base, str(repo / "model.safetensors"))
    (repo / ".thetamerge").write_text(thetamerge)
    repo.commit("base", ".gitattributes", "model.safetensors", ".thetamerge")
    repo.git("checkout", "-q", "-b", "theirs")
    save_file({"w": base["w"] + 1}, str(repo / "model.safetensors"))
    repo.commit("theirs", "model.safetensors")
    repo.git("checkout", "-q", "main")
    save_file({"w": base["w"] - 1}, str(repo / "model.safetensors"))
    repo.commit("ours", "model.safetensors")
    return repo


@pytest.mark.parametrize("thetamerge,fragments", [
    ('[default]\nstrategy = "average"\nalpha = 1e308\n', ["CONFLICT in model.safetensors", "w: strategy 'average'",
                                                         "NaN/inf"]),
    pytest.param('[default]\nstrategy = "slerp"\nt = nan\n', ["t: expected a finite number"], marks=pytest.mark.slow),
    pytest.param("[default]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n", ["nested 100000 deep"],
                 marks=pytest.mark.slow),
], ids=["overflow", "nan", "deep"])
def test_git_merge_with_a_hostile_thetamerge_stops_cleanly(tmp_path, thetamerge, fragments):
    genv = GitEnv.create(tmp_path)
    repo = _diverged(genv, thetamerge)
    ours = (repo / "model.safetensors").read_bytes()
    res = limited_git(repo, "merge", "--no-edit", "theirs")
    assert not res.timed_out and res.returncode != 0, res.err
    for f in fragments:
        assert f in res.err, res.err
    assert "Traceback" not in res.err and "RecursionError" not in res.err
    # the working tree still holds a readable checkpoint (ours), never NaN weights
    assert (repo / "model.safetensors").read_bytes() == ours
    assert np.isfinite(load_file(str(repo / "model.safetensors"))["w"]).all()
