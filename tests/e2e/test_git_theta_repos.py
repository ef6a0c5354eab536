"""Repositories committed by the real Git-Theta 0.2.0 (fixtures/git_theta: flat PyTorch state dicts;
fixtures/git_theta/nested: a nested Flax checkpoint), used with theta through real git and git-lfs: clone (LFS
objects from a file:// remote through git-lfs), check out, status clean, diff, new commits on top in theta's
format, migrate; Git-Theta's side-loaded workflow.

Values are compared with what Git-Theta itself checked out (expected.json: sha256 of each group's
little-endian bytes, recorded by make_fixtures.py while the real Git-Theta ran).

The fast tests (default run) share one clone per fixture repository and one theta repository for the
side-loaded workflow (module-scoped; each test leaves its repository clean); the exhaustive ones (every
commit, every file) are @slow and clone afresh.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from support.gitrepo import GitEnv, Repo, clone_bundle
from support.gittheta import assert_matches_git_theta, checked_out, le_sha256

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
COMMITS = [c for c in EXPECTED["commits"] if c["files"]]
HEAD_SHA = EXPECTED["commits"][-1]["sha"]
NESTED = FIXTURE / "nested"
NESTED_EXPECTED = json.loads((NESTED / "expected.json").read_text())
NESTED_COMMITS = [c for c in NESTED_EXPECTED["commits"] if c["files"]]


@pytest.fixture()
def clone(tmp_path) -> Repo:
    return clone_bundle(tmp_path, FIXTURE)


@pytest.fixture(scope="module")
def shared_clone(tmp_path_factory) -> Repo:
    """One clone of the flat fixture for the fast tests (each leaves it clean)."""
    return clone_bundle(tmp_path_factory.mktemp("gt-flat"), FIXTURE)


@pytest.fixture(scope="module")
def nested_clone(tmp_path_factory) -> Repo:
    """One clone of the nested (Flax) fixture for the fast tests."""
    return clone_bundle(tmp_path_factory.mktemp("gt-nested"), NESTED)


# ---------------------------------------------------------------- fast: one clone per fixture repository

def test_fast_head_checks_out_bit_for_bit_and_status_stays_clean(shared_clone):
    repo = shared_clone
    assert_matches_git_theta(repo, COMMITS[-1])
    for f in COMMITS[-1]["files"]:
        (repo / f).touch()  # stat changed: git runs the clean filter again
    assert repo.status() == ""


def test_fast_theta_diff_between_git_theta_commits(shared_clone):
    out = shared_clone.theta("diff", COMMITS[0]["sha"], COMMITS[1]["sha"], "--", "model.pt").stdout.decode()
    assert "modified  emb.weight" in out and "added     fc3.weight" in out and "removed   buf.index" in out
    assert "3 modified, 1 added, 1 removed, 7 unchanged" in out


def test_fast_new_commit_on_top_then_migrate(shared_clone):
    repo = shared_clone
    sd = torch.load(repo / "model.pt", weights_only=True)
    sd["fc1.bias"] = sd["fc1.bias"] + 1
    torch.save(sd, repo / "model.pt")
    repo.commit("on top, with theta", "model.pt")
    assert repo.show("HEAD:model.pt").startswith(b"theta-metadata 3\n")
    assert repo.show("HEAD:head.pt").startswith(b"{")  # untouched files stay Git-Theta format
    proc = repo.theta("migrate")
    assert "migrated head.pt: 2 groups" in proc.stdout.decode() and "migrated sub/emb.pt" in proc.stdout.decode()
    assert "stays in Git-Theta's format" in proc.stderr.decode()
    assert sorted(repo.status().splitlines()) == ["M  head.pt", "M  sub/emb.pt"]
    for f in ("model.pt", "head.pt", "sub/emb.pt"):
        assert repo.show(f":{f}").startswith(b"theta-metadata 3\n")
    repo.git("commit", "-q", "-m", "migrate")
    got = checked_out(repo / "model.pt")
    for name, v in sd.items():
        assert np.array_equal(got[name], v.numpy()), name
    assert repo.status() == ""


def test_fast_nested_checkout_diff_and_commit_on_top(nested_clone):
    repo = nested_clone
    head = NESTED_COMMITS[-1]
    assert_matches_git_theta(repo, head)  # nested dicts, "x/y" one key, float64 where the updates promoted
    (repo / "params.msgpack").touch()
    assert repo.status() == ""
    out = repo.theta("diff", NESTED_COMMITS[0]["sha"], NESTED_COMMITS[1]["sha"]).stdout.decode()
    assert "modified  params/Dense_0/kernel" in out and "added     params/Dense_2/kernel" in out
    assert "removed   batch_stats/BatchNorm_0/var" in out
    tree = torch.load(repo / "params.msgpack", weights_only=True)
    tree["params"]["Dense_0"]["bias"] = tree["params"]["Dense_0"]["bias"] * 2
    torch.save(tree, repo / "params.msgpack")
    repo.commit("on top of nested Git-Theta history", "params.msgpack")
    assert repo.show("HEAD:params.msgpack").startswith(b"theta-metadata 3\n")
    out = repo.theta("diff", head["sha"], "HEAD").stdout.decode()
    assert "modified  params/Dense_0/bias" in out and "1 modified" in out
    (repo / "params.msgpack").unlink()
    repo.git("checkout", "--", "params.msgpack")
    back = torch.load(repo / "params.msgpack", weights_only=True)
    assert torch.equal(back["params"]["Dense_0"]["bias"], tree["params"]["Dense_0"]["bias"])
    assert back["x/y"].dtype == torch.float32 and back["params"]["Dense_1"]["kernel"].dtype == torch.float64
    assert repo.status() == ""


@pytest.mark.slow
def test_every_commit_checks_out_as_git_theta_did_and_status_stays_clean(clone):
    for commit in COMMITS:
        clone.git("checkout", "-q", commit["sha"])
        assert_matches_git_theta(clone, commit)
        for f in commit["files"]:
            (clone / f).touch()  # stat changed: git runs the clean filter again
        assert clone.status() == "", commit["subject"]
        for f in commit["files"]:  # and the clean filter gives back Git-Theta's committed text, byte for byte
            text = clone.git("theta", "clean", f, input=(clone / f).read_bytes()).stdout
            assert text == clone.show(f"{commit['sha']}:{f}")


@pytest.mark.slow
def test_checked_out_file_loads_in_torch(clone):
    sd = torch.load(clone / "model.pt", weights_only=True)
    want = COMMITS[-1]["files"]["model.pt"]
    assert sorted(sd) == sorted(want)
    for name, w in want.items():
        assert le_sha256(sd[name].numpy()) == w["sha256"]


@pytest.mark.slow
def test_git_diff_and_theta_diff_between_git_theta_commits(clone):
    c1, c2 = COMMITS[0]["sha"], COMMITS[1]["sha"]
    out = clone.git("diff", c1, c2, "--", "model.pt").stdout.decode()
    assert "modified  emb.weight" in out and "added     fc3.weight" in out and "removed   buf.index" in out
    out = clone.theta("diff", c1, c2).stdout.decode()
    assert "3 modified, 1 added, 1 removed, 7 unchanged" in out
    out = clone.theta("diff", COMMITS[3]["sha"], HEAD_SHA, "--", "head.pt").stdout.decode()
    assert "update low-rank" in out and "2 modified" in out


@pytest.mark.slow
def test_new_commit_on_top_is_stored_in_theta_format_and_history_mixes(clone):
    sd = torch.load(clone / "model.pt", weights_only=True)
    sd["fc1.bias"] = sd["fc1.bias"] + 1
    torch.save(sd, clone / "model.pt")
    assert clone.status() == "M model.pt"
    clone.commit("on top, with theta", "model.pt")
    assert clone.show("HEAD:model.pt").startswith(b"theta-metadata 3\n")
    assert clone.show("HEAD:head.pt").startswith(b"{")  # untouched files stay Git-Theta format
    for commit in (COMMITS[2], COMMITS[-1]):  # back into Git-Theta history and forward again
        clone.git("checkout", "-q", commit["sha"])
        assert_matches_git_theta(clone, commit)
    clone.git("checkout", "-q", "main")
    got = checked_out(clone / "model.pt")
    for name, v in sd.items():
        assert np.array_equal(got[name], v.numpy()), name
    (clone / "model.pt").touch()
    assert clone.status() == ""
    out = clone.theta("diff", HEAD_SHA, "HEAD").stdout.decode()
    assert "modified  fc1.bias" in out and "1 modified" in out


# ---------------------------------------------------------------- Git-Theta's side-loaded workflow

def _base_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"fc.weight": torch.randn(8, 6, generator=g), "fc.bias": torch.randn(8, generator=g),
            "norm.weight": torch.randn(6, generator=g), "other": torch.arange(5, dtype=torch.int64)}


def _update(kind: str, base: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Git-Theta's update file and the values Git-Theta's arithmetic gives (numpy, as in its updates/)."""
    g = torch.Generator().manual_seed(11)
    w = base["fc.weight"].numpy()
    if kind == "low-rank":
        R, C = torch.randn(8, 2, generator=g), torch.randn(2, 6, generator=g)
        return {"fc.weight/R": R, "fc.weight/C": C}, {"fc.weight": R.numpy() @ C.numpy() + w}
    if kind == "ia3":
        s = torch.rand(8, 1, generator=g) + 0.5
        return {"fc.weight/ia3": s}, {"fc.weight": w * s.numpy()}
    idx = torch.tensor([0, 7, 30], dtype=torch.int32)
    vals = torch.tensor([1.5, -2.0, 0.25])
    dense = np.zeros(48, np.float32)
    dense[idx.numpy()] += vals.numpy()
    return ({"fc.weight/data": vals, "fc.weight/indices": idx, "fc.weight/indptr": torch.tensor([0, 3], dtype=torch.int32),
             "fc.weight/shape": torch.tensor([8, 6])}, {"fc.weight": dense.reshape(8, 6) + w})


@pytest.fixture()
def theta_repo(tmp_path) -> Repo:
    env = GitEnv.create(tmp_path)
    repo = env.init("work")
    torch.save(_base_model(), repo / "model.pt")
    repo.commit("base", ".gitattributes", "model.pt")
    return repo


@pytest.fixture(scope="module")
def sideload_repo(tmp_path_factory) -> Repo:
    """One theta repository for the fast side-loaded tests; each commits on top of the last and leaves it clean."""
    env = GitEnv.create(tmp_path_factory.mktemp("gt-sideload"))
    repo = env.init("work")
    torch.save(_base_model(), repo / "model.pt")
    repo.commit("base", ".gitattributes", "model.pt")
    return repo


def _update_on(kind: str, current: dict[str, np.ndarray], seed: int, factor_dtype=torch.float32
               ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """A Git-Theta update file for fc.weight over ``current`` and the value Git-Theta's arithmetic gives."""
    g = torch.Generator().manual_seed(seed)
    w = current["fc.weight"]
    if kind == "low-rank":
        R, C = torch.randn(8, 2, generator=g, dtype=factor_dtype), torch.randn(2, 6, generator=g, dtype=factor_dtype)
        return {"fc.weight/R": R, "fc.weight/C": C}, R.numpy() @ C.numpy() + w
    if kind == "ia3":
        s = torch.rand(8, 1, generator=g, dtype=factor_dtype) + 0.5
        return {"fc.weight/ia3": s}, w * s.numpy()
    idx = torch.tensor([seed % 48, 7, 30], dtype=torch.int32)
    vals = torch.tensor([1.5, -2.0, 0.25], dtype=factor_dtype)
    dense = np.zeros(48, vals.numpy().dtype)
    np.add.at(dense, idx.numpy(), vals.numpy())
    return ({"fc.weight/data": vals, "fc.weight/indices": idx, "fc.weight/indptr": torch.tensor([0, 3], dtype=torch.int32),
             "fc.weight/shape": torch.tensor([8, 6])}, dense.reshape(8, 6) + w)


def _side_load(repo: Repo, kind: str, update: dict[str, torch.Tensor], flag: str = "--update-data") -> None:
    torch.save(update, repo / "update.bin")
    repo.theta("add", "model.pt", "--update-type", kind, flag, "update.bin")
    (repo / "update.bin").unlink()


@pytest.mark.parametrize("kind", ["sparse", "low-rank", "ia3"])
def test_fast_side_loaded_update_original_then_current_form(sideload_repo, kind):
    """Git-Theta's documented form (the work tree holds the original), then the current form (it holds
    previous-with-update already), one commit each, on one repository."""
    repo = sideload_repo
    base = checked_out(repo / "model.pt")
    update, want = _update_on(kind, base, seed=len(kind))
    _side_load(repo, kind, update, "--update-path")  # Git-Theta's README spelling
    repo.git("commit", "-q", "-m", f"{kind}, original form")
    got = checked_out(repo / "model.pt")  # the work tree, as the add left it: what is committed
    assert got["fc.weight"].dtype == want.dtype and np.array_equal(got["fc.weight"], want)
    for name in ("fc.bias", "norm.weight", "other"):
        assert np.array_equal(got[name], base[name])
    assert repo.status() == ""
    assert _last_step(repo, "fc.weight") == kind

    update, want = _update_on(kind, got, seed=len(kind) + 1)
    torch.save({**{k: torch.from_numpy(v) for k, v in got.items()}, "fc.weight": torch.from_numpy(want)},
               repo / "model.pt")
    before = (repo / "model.pt").read_bytes()
    _side_load(repo, kind, update)
    assert (repo / "model.pt").read_bytes() == before  # the current form: nothing to rewrite
    repo.git("commit", "-q", "-m", f"{kind}, current form")
    (repo / "model.pt").unlink()
    repo.git("checkout", "model.pt")
    assert np.array_equal(checked_out(repo / "model.pt")["fc.weight"], want)
    assert repo.status() == ""
    assert _last_step(repo, "fc.weight") == kind


def assert_third_value_refused(repo) -> None:
    """`git theta add --update-type ia3` of a model.pt whose fc.weight is the previous version + 3 (neither
    it nor it with update.bin applied) fails naming both distances, leaving the file and the index as they were."""
    before = (repo / "model.pt").read_bytes()
    proc = repo.theta("add", "model.pt", "--update-type", "ia3", "--update-data", "update.bin", check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert "'fc.weight' is neither the previous version (max abs difference 3)" in err
    assert "previous version with the ia3 update" in err and "max abs difference" in err.split("applied")[1]
    assert (repo / "model.pt").read_bytes() == before
    assert repo.out("diff", "--cached", "--name-only") == ""


def test_fast_side_loaded_update_refuses_a_third_value(sideload_repo):
    repo = sideload_repo
    current = checked_out(repo / "model.pt")
    update, _ = _update_on("ia3", current, seed=5)
    torch.save(update, repo / "update.bin")
    torch.save({**{k: torch.from_numpy(v) for k, v in current.items()},
                "fc.weight": torch.from_numpy(current["fc.weight"] + 3)}, repo / "model.pt")
    assert_third_value_refused(repo)
    (repo / "update.bin").unlink()
    repo.git("checkout", "model.pt")


def _last_step(repo: Repo, group: str) -> str:
    steps = [json.loads(line) for line in repo.show("HEAD:model.pt").decode().splitlines()[1:]
             if not line.startswith("#")]
    return next(s for s in steps if s.get("group") == group)["steps"][-1]["type"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse", "low-rank", "ia3"])
def test_side_loaded_update_promotes_as_git_theta_checks_out(theta_repo, kind):
    """float64 factors on a float32 group: Git-Theta checks out numpy's promotion (float64; see
    fixtures/git_theta/nested, commits N4 and N6); theta commits that value (dense: it changed dtype)."""
    repo = theta_repo
    base = checked_out(repo / "model.pt")
    update, want = _update_on(kind, base, seed=3, factor_dtype=torch.float64)
    assert want.dtype == np.float64
    _side_load(repo, kind, update)
    repo.git("commit", "-q", "-m", f"{kind} promoting")
    assert checked_out(repo / "model.pt")["fc.weight"].dtype == np.float64
    assert np.array_equal(checked_out(repo / "model.pt")["fc.weight"], want)
    assert repo.status() == ""
    (repo / "model.pt").unlink()
    repo.git("checkout", "model.pt")
    assert np.array_equal(checked_out(repo / "model.pt")["fc.weight"], want)
    assert _last_step(repo, "fc.weight") == "dense"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse", "low-rank", "ia3"])
@pytest.mark.parametrize("form", ["original", "updated"])
def test_side_loaded_update_both_forms(theta_repo, kind, form):
    repo = theta_repo
    base = _base_model()
    update, want = _update(kind, base)
    torch.save(update, repo / "update.bin")
    if form == "updated":  # the current form: the work tree already holds previous-with-update
        torch.save({**base, "fc.weight": torch.from_numpy(want["fc.weight"])}, repo / "model.pt")
    flag = "--update-path" if kind == "low-rank" else "--update-data"  # both spellings work
    repo.theta("add", "model.pt", "--update-type", kind, flag, "update.bin")
    repo.git("commit", "-q", "-m", f"{kind} {form}")
    got = checked_out(repo / "model.pt")  # the work tree, as the add left it
    assert np.array_equal(got["fc.weight"], want["fc.weight"]), "previous (+ or *) update, Git-Theta's arithmetic"
    for name in ("fc.bias", "norm.weight", "other"):
        assert np.array_equal(got[name], base[name].numpy())
    assert repo.status() == "?? update.bin"
    (repo / "model.pt").unlink()
    repo.git("checkout", "model.pt")
    assert np.array_equal(checked_out(repo / "model.pt")["fc.weight"], want["fc.weight"])
    steps = [json.loads(line) for line in repo.show("HEAD:model.pt").decode().splitlines()[1:] if not line.startswith("#")]
    fc = next(s for s in steps if s.get("group") == "fc.weight")
    assert fc["steps"][-1]["type"] == kind


@pytest.mark.slow
def test_side_loaded_update_refuses_a_third_value(theta_repo):
    repo = theta_repo
    base = _base_model()
    update, _ = _update("ia3", base)
    torch.save(update, repo / "update.bin")
    torch.save({**base, "fc.weight": base["fc.weight"] + 3}, repo / "model.pt")
    assert_third_value_refused(repo)


@pytest.mark.slow
def test_side_loaded_update_on_git_theta_history(clone):
    """The original checkpoint (as Git-Theta checked it out) plus a side-loaded update, on Git-Theta history."""
    w = checked_out(clone / "model.pt")["fc1.weight"]
    s = np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(8, 1)
    torch.save({"fc1.weight/ia3": torch.from_numpy(s)}, clone / "upd.bin")
    clone.theta("add", "model.pt", "--update-type", "ia3", "--update-data", "upd.bin")
    clone.git("commit", "-q", "-m", "ia3 on Git-Theta history")
    assert np.array_equal(checked_out(clone / "model.pt")["fc1.weight"], w * s)
    assert clone.status() == "?? upd.bin"
    assert clone.show("HEAD:model.pt").startswith(b"theta-metadata 3\n")


# ---------------------------------------------------------------- migrate

@pytest.mark.slow
def test_migrate_stages_theta_format_and_keeps_values(clone):
    proc = clone.theta("migrate")
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert "migrated model.pt: 11 groups" in out and "migrated head.pt" in out and "migrated sub/emb.pt" in out
    assert "stays in Git-Theta's format" in err
    assert sorted(clone.status().splitlines()) == ["M  head.pt", "M  model.pt", "M  sub/emb.pt"]
    for f in ("model.pt", "head.pt", "sub/emb.pt"):
        assert clone.show(f":{f}").startswith(b"theta-metadata 3\n")
    clone.git("commit", "-q", "-m", "migrate")
    for f in ("model.pt", "head.pt", "sub/emb.pt"):
        (clone / f).unlink()
    clone.git("checkout", "--", ".")
    assert_matches_git_theta(clone, COMMITS[-1])
    assert clone.status() == ""
    assert "nothing to migrate" in clone.theta("migrate").stderr.decode()


@pytest.mark.slow
def test_migrate_refuses_an_unknown_update_type_and_stages_nothing(clone):
    text = clone.show("HEAD:head.pt").replace(b'"update_type": "low-rank"', b'"update_type": "lora-x"', 1)
    oid = clone.git("hash-object", "-w", "--stdin", input=text).stdout.decode().strip()
    clone.git("update-index", "--cacheinfo", f"100644,{oid},head.pt")
    index_before = clone.out("ls-files", "-s")
    proc = clone.theta("migrate", check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1
    assert "head.pt" in err and "head.bias" in err and "'lora-x'" in err
    assert clone.out("ls-files", "-s") == index_before
