"""Each merge strategy against a plain numpy implementation of its definition (docs/guide/merging.md, "Strategies").

The references below are written independently of theta.merges.strategies: whole-array numpy, no chunks,
np.sort for the TIES threshold. Math precision is the documented one: float32 for float32/bf16 groups.
"""
from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest

import theta.merges as merges
from theta.base.errors import MergeError
from theta.merges.strategies import base as strategies, sparsified

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32


# ---------- references -------------------------------------------------------------------------------------

def ref_average(A, B, O, alpha=0.5):
    a, b = A.astype(F32), B.astype(F32)
    return (a * F32(alpha) + b * F32(1 - alpha)).astype(A.dtype)


def ref_task_arithmetic(A, B, O, lambda_ours=1.0, lambda_theirs=1.0):
    a, b, o = A.astype(F32), B.astype(F32), O.astype(F32)
    return (o + F32(lambda_ours) * (a - o) + F32(lambda_theirs) * (b - o)).astype(A.dtype)


def ref_ties(A, B, O, density=0.2, lam=1.0):
    a, b, o = A.astype(F32).ravel(), B.astype(F32).ravel(), O.astype(F32).ravel()
    trimmed = []
    for tau in (a - o, b - o):
        k = max(1, int(round(density * tau.size)))
        keep = np.ones(tau.size, bool) if k >= tau.size else np.abs(tau) >= np.sort(np.abs(tau))[-k]
        trimmed.append(np.where(keep, tau, F32(0)))
    stack = np.stack(trimmed)
    elected = np.sign(stack.sum(axis=0))
    agree = (stack != 0) & (np.sign(stack) == elected)
    merged = (stack * agree).sum(axis=0) / np.maximum(agree.sum(axis=0), 1)
    return (o + F32(lam) * merged.astype(F32)).astype(A.dtype).reshape(A.shape)


def ref_dare(name, A, B, O, density=0.2, lambda_ours=1.0, lambda_theirs=1.0, seed=0):
    a, b, o = A.astype(F32).ravel(), B.astype(F32).ravel(), O.astype(F32).ravel()
    out = o.copy()
    for side, x, lam in (("ours", a, lambda_ours), ("theirs", b, lambda_theirs)):
        digest = hashlib.sha256(f"theta-dare\0{seed}\0{name}\0{side}".encode()).digest()
        rng = np.random.default_rng(np.random.SeedSequence(int.from_bytes(digest[:16], "little")))
        keep = rng.random(x.size) < density
        out = out + np.where(keep, x - o, F32(0)) * F32(lam / density)
    return out.astype(A.dtype).reshape(A.shape)


def ref_slerp(A, B, O, t=0.5):
    a64, b64 = A.astype(np.float64).ravel(), B.astype(np.float64).ravel()
    cos = a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64))
    if abs(cos) > 0.9995:
        ca, cb = 1 - t, t
    else:
        theta = math.acos(cos)
        ca, cb = math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
    return (A.astype(F32) * F32(ca) + B.astype(F32) * F32(cb)).astype(A.dtype)


# ---------- helpers -------------------------------------------------------------------------------------------

def triple(dtype, shape=(64, 96), seed=0):
    rng = np.random.default_rng(seed)
    O = rng.normal(0, 0.02, shape).astype(F32)
    A = O + rng.normal(0, 0.002, shape).astype(F32)
    B = O + rng.normal(0, 0.002, shape).astype(F32)
    return A.astype(dtype), B.astype(dtype), O.astype(dtype)


def assert_close(got, want, A, B, O):
    """1e-6 relative to the inputs' magnitude for float32; for bf16 equal except rare 1-ulp rounding flips."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.astype(np.float64), want.astype(np.float64)
    if got.dtype == BF16:
        diff = g != w
        assert diff.mean() < 1e-3, f"{diff.sum()} bf16 elements differ"
        ulp = np.abs(w[diff]) * 2.0 ** -7
        assert np.all(np.abs(g[diff] - w[diff]) <= ulp + 1e-30)
    else:
        scale = np.abs(A.astype(np.float64)) + np.abs(B.astype(np.float64)) + np.abs(O.astype(np.float64))
        np.testing.assert_array_less(np.abs(g - w), 1e-6 * scale + 1e-30)


DTYPES = [np.dtype(F32), BF16]


@pytest.fixture(params=[None, 1000], ids=["one-chunk", "many-chunks"])
def chunk(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(strategies, "CHUNK", request.param)
    return request.param


# ---------- strategies vs references ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_average(dtype, alpha, chunk):
    A, B, O = triple(dtype)
    got = merges.get("average").merge("w", A, B, O, alpha=alpha)
    assert_close(got, ref_average(A, B, O, alpha), A, B, O)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lams", [(1.0, 1.0), (0.5, 0.8)])
def test_task_arithmetic(dtype, lams, chunk):
    A, B, O = triple(dtype, seed=1)
    got = merges.get("task-arithmetic").merge("w", A, B, O, lambda_ours=lams[0], lambda_theirs=lams[1])
    assert_close(got, ref_task_arithmetic(A, B, O, *lams), A, B, O)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density,lam", [(0.2, 1.0), (0.5, 0.7), (1.0, 1.0), (0.01, 2.0)])
def test_ties(dtype, density, lam, chunk):
    A, B, O = triple(dtype, seed=2)
    got = merges.get("ties").merge("w", A, B, O, density=density, **{"lambda": lam})
    want = ref_ties(A, B, O, density, lam)
    assert_close(got, want, A, B, O)
    if density < 1:  # trimming really happened: elements trimmed on both sides stay at the ancestor
        assert np.mean(got == O) > 0.9 * (1 - density) ** 2


def test_ties_sign_election_by_hand():
    O = np.zeros(4, F32)
    A = np.array([1.0, -2.0, 3.0, 0.0], F32)
    B = np.array([3.0, 1.0, -1.0, 5.0], F32)
    got = merges.get("ties").merge("w", A, B, O, density=1.0)
    # [1,3] agree: mean 2; [-2,1] sum<0: only -2; [3,-1] sum>0: only 3; [0,5]: only 5
    np.testing.assert_array_equal(got, np.array([2.0, -2.0, 3.0, 5.0], F32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.2, 0.9, 1.0])
def test_dare(dtype, density, chunk):
    A, B, O = triple(dtype, seed=3)
    got = merges.get("dare").merge("enc.w", A, B, O, density=density)
    assert_close(got, ref_dare("enc.w", A, B, O, density), A, B, O)


def test_dare_is_reproducible_and_depends_on_name_and_seed():
    A, B, O = triple(np.dtype(F32), seed=4)
    dare = merges.get("dare")
    first = dare.merge("a", A, B, O, density=0.3)
    np.testing.assert_array_equal(first, dare.merge("a", A, B, O, density=0.3))
    assert not np.array_equal(first, dare.merge("b", A, B, O, density=0.3))
    assert not np.array_equal(first, dare.merge("a", A, B, O, density=0.3, seed=7))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [0.5, 0.25])
def test_slerp(dtype, t, chunk):
    rng = np.random.default_rng(5)
    A = rng.normal(0, 1, (50, 70)).astype(dtype)
    B = rng.normal(0, 1, (50, 70)).astype(dtype)
    got = merges.get("slerp").merge("w", A, B, None, t=t)
    want = ref_slerp(A, B, None, t)
    assert_close(got, want, A, B, np.zeros_like(A))
    # really spherical: for orthogonal-ish random vectors the midpoint's norm exceeds the linear one
    lin = 0.5 * (A.astype(np.float64) + B.astype(np.float64))
    if t == 0.5:
        assert np.linalg.norm(got.astype(np.float64)) > 1.3 * np.linalg.norm(lin)


def test_slerp_parallel_falls_back_to_linear():
    A = np.linspace(1, 2, 100, dtype=F32)
    B = A * F32(3)
    got = merges.get("slerp").merge("w", A, B, None, t=0.25)
    np.testing.assert_allclose(got, 0.75 * A + 0.25 * B, rtol=1e-6)


@pytest.mark.parametrize("name,side", [("ours", 0), ("theirs", 1), ("ancestor", 2)])
def test_pick_strategies_return_the_side_unchanged(name, side):
    A, B, O = triple(BF16)
    got = merges.get(name).merge("w", A, B, O)
    assert got.tobytes() == (A, B, O)[side].tobytes()


# ---------- radix selection -------------------------------------------------------------------------------------

@pytest.mark.parametrize("wd", [np.float32, np.float64])
def test_kth_largest_magnitude_matches_sort(wd):
    rng = np.random.default_rng(6)
    x = rng.normal(0, 1, 5000).astype(wd)
    x[:1000] = 0.0          # many ties at zero
    x[1000:1100] = -0.5     # ties at an exact value, negative
    x[1100] = -0.0
    srt = np.sort(np.abs(x))
    for k in [1, 2, 50, 1100, 3999, 4000, 4001, 4900, 5000]:
        got = sparsified.kth_largest_magnitude(lambda: iter(np.array_split(x, 7)), k, np.dtype(wd))
        assert got == srt[-k], k


# ---------- registry, applicability, parameter errors -------------------------------------------------------------

def test_registry_lists_builtins_in_order():
    assert merges.names()[:8] == ["ours", "theirs", "ancestor", "average", "task-arithmetic", "ties", "dare", "slerp"]
    with pytest.raises(MergeError, match="unknown merge strategy 'nope'; known: ours, theirs"):
        merges.get("nope")


def test_applicable():
    assert merges.applicable("float32", True) == merges.names()
    assert merges.applicable("bfloat16", False) == ["ours", "theirs", "average", "slerp"]
    assert merges.applicable("int64", True) == ["ours", "theirs", "ancestor"]


def test_parameter_errors():
    A, B, O = triple(np.dtype(F32))
    with pytest.raises(MergeError, match="'average' has no parameter density; its parameters: alpha"):
        merges.get("average").merge("w", A, B, O, density=0.1)
    with pytest.raises(MergeError, match="density must be in"):
        merges.get("ties").merge("w", A, B, O, density=0)
    with pytest.raises(MergeError, match="alpha='x' is not a number"):
        merges.get("average").merge("w", A, B, O, alpha="x")


def test_shape_dtype_and_kind_errors():
    A, B, O = triple(np.dtype(F32))
    with pytest.raises(MergeError, match="group 'w': theirs is float32\\[10\\] but ours is float32\\[64, 96\\]"):
        merges.get("average").merge("w", A, B[0, :10], O)
    with pytest.raises(MergeError, match="needs the common ancestor"):
        merges.get("ties").merge("w", A, B, None)
    ints = np.arange(6)
    with pytest.raises(MergeError, match="only merges floating-point groups, not int64"):
        merges.get("average").merge("w", ints, ints, ints)


# ---------- configuration: env > .thetamerge rule > git config > .thetamerge default ------------------------------

def _repo(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    return tmp_path / "r"


def _git_config(repo, key, value):
    import subprocess

    subprocess.run(["git", "-C", str(repo), "config", key, value], check=True)


def test_config_layers(tmp_path, monkeypatch):
    from theta.settings.merge_rules import MergeConfig

    repo = _repo(tmp_path, monkeypatch)
    assert not MergeConfig.load(repo, environ={}).configured
    assert MergeConfig.load(repo, environ={}).choose("m.pt", "w").strategy is None

    (repo / ".thetamerge").write_text(
        '[default]\nstrategy = "average"\nalpha = 0.25\n\n'
        '[[rule]]\ngroups = ["*embed*", "lm_head.*"]\nstrategy = "ours"\n\n'
        '[[rule]]\npaths = "adapters/*"\ngroups = "*"\nstrategy = "ties"\ndensity = 0.4\n\n'
        '[[rule]]\ngroups = "layer.1.*"\nlambda = 0.5\n')
    cfg = MergeConfig.load(repo, environ={})
    assert cfg.choose("m.pt", "layer.0.w") == cfg.choose("m.pt", "layer.0.w")
    c = cfg.choose("m.pt", "layer.0.w")
    assert (c.strategy, c.params["alpha"], c.source) == ("average", 0.25, ".thetamerge [default]")
    c = cfg.choose("m.pt", "tok_embed.weight")
    assert c.strategy == "ours" and c.source.startswith(".thetamerge rule 1")
    c = cfg.choose("adapters/a.safetensors", "layer.1.w")
    assert (c.strategy, c.params["density"], c.params["lambda"]) == ("ties", 0.4, 0.5)

    _git_config(repo, "theta.merge.strategy", "task-arithmetic")
    _git_config(repo, "theta.merge.lambda-ours", "0.75")
    cfg = MergeConfig.load(repo, environ={})
    c = cfg.choose("m.pt", "layer.0.w")
    assert (c.strategy, c.params["lambda_ours"], c.source) == ("task-arithmetic", 0.75, "git config theta.merge.strategy")
    assert cfg.choose("m.pt", "tok_embed.weight").strategy == "ours"  # a rule is more specific than git config

    env = {"GIT_THETA_MERGE_STRATEGY": "dare", "GIT_THETA_MERGE_DENSITY": "0.9", "GIT_THETA_MERGE_LAMBDA_OURS": "2"}
    cfg = MergeConfig.load(repo, environ=env)
    for group in ("layer.0.w", "tok_embed.weight"):
        c = cfg.choose("adapters/x", group)
        assert (c.strategy, c.params["density"], c.params["lambda_ours"]) == ("dare", 0.9, 2.0)


def test_config_errors(tmp_path, monkeypatch):
    from theta.settings.merge_rules import MergeConfig

    repo = _repo(tmp_path, monkeypatch)
    (repo / ".thetamerge").write_text('[[rule]]\ngroups = 3\nstrategy = "ours"\n')
    with pytest.raises(MergeError, match="rule 1 groups: expected a glob or a list of globs, got 3"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").write_text('[defaults]\nstrategy = "ours"\n')
    with pytest.raises(MergeError, match="unknown table\\(s\\) defaults"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").write_text('[default\n')
    with pytest.raises(MergeError, match="not valid TOML"):
        MergeConfig.load(repo, environ={})
    (repo / ".thetamerge").unlink()
    with pytest.raises(MergeError, match="GIT_THETA_MERGE_DENSITY: expected a number, got 'lots'"):
        MergeConfig.load(repo, environ={"GIT_THETA_MERGE_DENSITY": "lots"})


# ---------- property: exact selection and TIES on arbitrary float32 data -------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300),
                  elements=st.floats(-1e3, 1e3, width=32, allow_nan=False, allow_subnormal=True)),
       st.floats(0.01, 1.0))
def test_kth_largest_and_ties_properties(x, density):
    srt = np.sort(np.abs(x))
    k = max(1, int(round(density * x.size)))
    got = sparsified.kth_largest_magnitude(lambda: iter(np.array_split(x, 3)), k, np.dtype(np.float32))
    assert got == srt[-k]
    O = np.zeros_like(x)
    B = x[::-1].copy()
    merged = merges.get("ties").merge("p", x, B, O, density=density)
    np.testing.assert_array_equal(merged, ref_ties(x, B, O, density, 1.0))


def test_unknown_parameter_names_are_refused(tmp_path, monkeypatch):
    from theta.settings.merge_rules import MergeConfig

    repo = _repo(tmp_path, monkeypatch)
    known = {k for n in merges.names() for k in merges.get(n).defaults}
    MergeConfig.load(repo, environ={"GIT_THETA_MERGE_DENSITY": "0.3"}).check_parameters(known)
    with pytest.raises(MergeError, match="unknown merge parameter environment GIT_THETA_MERGE_DENSTY; parameters"):
        MergeConfig.load(repo, environ={"GIT_THETA_MERGE_DENSTY": "0.3"}).check_parameters(known)
    _git_config(repo, "theta.merge.alfa", "0.3")
    with pytest.raises(MergeError, match="unknown merge parameter git config theta.merge.alfa"):
        MergeConfig.load(repo, environ={}).check_parameters(known)
