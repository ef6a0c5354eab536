"""Git-Theta's own end-to-end suite (its tests/end2end: checkout, commit, smudge, sparse, low-rank, ia3,
inprocess), run unchanged against theta.

The suite is Git-Theta's code, so it is not copied into this project: the tests read a clone of Git-Theta's
repository named by ``GIT_THETA_SUITE`` (its tests/end2end folder) and are skipped, saying so, without one:

    git clone https://github.com/r-three/git-theta /tmp/git-theta
    git -C /tmp/git-theta checkout 65d6e2114d14af1eeed092965d1f141f5ef478e2
    GIT_THETA_SUITE=/tmp/git-theta/tests/end2end python3 -m pytest -q -p no:cacheprovider -m slow \
        tests/e2e/test_git_theta_suite.py

Every file of that folder must be the one the pinned commit holds (tests/e2e/git_theta_suite.json: each file's
git blob id and mode), so "unchanged" is checked, not assumed. Each test.sh runs as Git-Theta's
runner.sh runs it (its clean script, then ``./test.sh`` in the test's folder, in a copy of the suite) with:
  - this checkout's ``git-theta`` and ``git-theta-filter`` first on PATH (so `git theta install`, `git theta
    track`, `git theta add` and the filters are theta's), in an isolated HOME and global git config;
  - ``python`` = Git-Theta 0.2.0's own environment (scripts/setup-git-theta.sh: PyPI's git-theta==0.2.0 and the
    CPU torch, never the project's interpreter): model.py builds the sparse, low-rank and ia3 update files with
    Git-Theta's own update handlers, and verify.py compares checkpoints with torch.load;
  - for inprocess, whose test.py does ``import git_theta`` and calls ``git_theta.save_to_git`` /
    ``git_theta.load_from_git``: ``python`` = this project's interpreter with theta standing in for git_theta
    (tests/support/git_theta_standin).

Slow: the environment takes about a minute to install the first time (kept under ~/.cache afterwards); the
suite runs about a minute more. Skipped, with the installer's last words, where Git-Theta cannot be installed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support.gitrepo import ROOT, GitEnv

SOURCE = json.loads((Path(__file__).with_name("git_theta_suite.json")).read_text())
TESTS = sorted({Path(f["file"]).parent.name for f in SOURCE["files"] if Path(f["file"]).name == "test.sh"})
SETUP = ROOT / "scripts" / "setup-git-theta.sh"
STANDIN = ROOT / "tests" / "support" / "git_theta_standin"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def suite() -> Path:
    """Git-Theta's tests/end2end (``GIT_THETA_SUITE``), checked file by file against the pinned commit."""
    where = os.environ.get("GIT_THETA_SUITE")
    if not where:
        pytest.skip("GIT_THETA_SUITE is not set: clone r-three/git-theta at "
                    f"{SOURCE['commit'][:12]} and point it at tests/end2end (see this module's docstring)")
    root = Path(where).resolve().parent  # the manifest names files as end2end/...
    for f in SOURCE["files"]:
        path = root / f["file"]
        if not path.is_file():
            pytest.fail(f"GIT_THETA_SUITE={where} has no {f['file']}: not Git-Theta's tests/end2end at "
                        f"{SOURCE['commit'][:12]}")
        assert git_blob_id(path.read_bytes()) == f["blob"], f"{f['file']} is not Git-Theta's, unchanged"
        executable = bool(path.stat().st_mode & stat.S_IXUSR)
        assert executable == (f["mode"] == "100755"), f["file"]
    return Path(where)


def test_the_manifest_names_the_seven_tests():
    assert TESTS == ["checkout", "commit", "ia3", "inprocess", "low-rank", "smudge", "sparse"]


def test_suite_files_are_git_thetas_unchanged(suite):
    """Every file of the suite is the one Git-Theta's repository holds at the recorded commit (checked by the
    fixture), and the folder holds nothing else that would run."""
    listed = {f["file"] for f in SOURCE["files"]}
    extra = [p for p in suite.rglob("*") if p.is_file() and "__pycache__" not in p.parts
             and f"end2end/{p.relative_to(suite).as_posix()}" not in listed]
    assert not extra, f"files not in Git-Theta's suite: {extra[:5]}"


@pytest.fixture(scope="module")
def git_theta_python() -> str:
    """Git-Theta 0.2.0's interpreter (installed by scripts/setup-git-theta.sh), or a skip saying why not."""
    if shutil.which("git-lfs") is None:
        pytest.skip("git-lfs is not installed (scripts/setup.sh installs it)")
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
        pytest.skip(f"Git-Theta 0.2.0 could not be installed by scripts/setup-git-theta.sh: {tail}")
    return proc.stdout.strip().splitlines()[-1]


def python_wrapper(bin_dir: Path, command: list[str], env: dict[str, str]) -> None:
    """``bin_dir/python``: runs ``command`` with ``env`` set (the suite calls a bare ``python``)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    unset = "" if "PYTHONPATH" in env else "unset PYTHONPATH\n"
    args = " ".join(f"'{c}'" for c in command)
    (bin_dir / "python").write_text(f"#!/bin/sh\n{unset}{exports}exec {args} \"$@\"\n")
    (bin_dir / "python").chmod(0o755)


@pytest.mark.slow
@pytest.mark.parametrize("name", TESTS)
def test_git_theta_end2end(name, suite, git_theta_python, tmp_path):
    copy = tmp_path / "end2end"
    shutil.copytree(suite, copy, ignore=shutil.ignore_patterns("__pycache__"))  # the tests write into their folders
    suite = copy
    env = GitEnv.create(tmp_path / "gitenv")
    shim = tmp_path / "shim"
    if name == "inprocess":  # theta stands in for git_theta, in this project's interpreter
        python_wrapper(shim, [sys.executable], {"PYTHONPATH": f"{STANDIN}{os.pathsep}{ROOT}"})
    else:  # Git-Theta's own environment; nothing of this checkout on its sys.path
        python_wrapper(shim, [git_theta_python], {})
    run_env = {**env.env, "PATH": f"{shim}{os.pathsep}{env.env['PATH']}"}
    test_dir = suite / name
    clean = "./clean.sh" if (test_dir / "clean.sh").exists() else "../clean.sh"
    subprocess.run([clean], cwd=test_dir, env=run_env, capture_output=True, timeout=60)  # as runner.sh does
    proc = subprocess.run(["./test.sh"], cwd=test_dir, env=run_env, capture_output=True, timeout=900)
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, f"Git-Theta's {name} test failed ({proc.returncode}):\n{out[-6000:]}"
