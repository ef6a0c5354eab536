#!/usr/bin/env bash
# Install Git-Theta 0.2.0 (the peer theta supersedes) in a virtual environment of its own, never in the
# project's: the Git-Theta suite test (tests/e2e/test_git_theta_suite.py) runs Git-Theta's model.py and
# verify.py with it, and fixtures/git_theta/make_fixtures.py runs there. torch is the CPU build, pinned first
# so nothing pulls the CUDA one; the rest is pinned to what made fixtures/git_theta (its expected.json).
# Prints the environment's python on stdout; safe to run repeatedly (a finished environment is kept).
#   GIT_THETA_VENV   where the environment goes (default ~/.cache/zipslice-theta/git-theta-0.2.0-venv)
#   PYTHON           the interpreter to build it from (default python3)
set -euo pipefail
VENV="${GIT_THETA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/zipslice-theta/git-theta-0.2.0-venv}"
PYTHON="${PYTHON:-python3}"
REQS=(git-theta==0.2.0 tensorstore==0.1.86 numpy==2.4.6 scipy==1.17.1 msgpack==1.2.4)
STAMP="$VENV/.complete"
WANT="torch==2.13.0 ${REQS[*]}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import git_theta, torch" 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
fi
rm -rf "$VENV"  # a half-made environment (an interrupted run) is made again, not patched
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install torch==2.13.0 >&2
"${PIP[@]}" install "${REQS[@]}" >&2
"$VENV/bin/python" -c "import git_theta, git_theta.updates, torch, numba" >&2
echo "$WANT" > "$STAMP"
echo "$VENV/bin/python"
