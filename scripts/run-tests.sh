#!/usr/bin/env bash
# Quick start #2: set everything up, build the docs strictly, then run the default test suite (slow tests
# excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build-docs.sh
exec python3 -m pytest -q -p no:cacheprovider "$@"
