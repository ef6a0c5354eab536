#!/usr/bin/env bash
# Quick start #1: set everything up, then run the main job (the demo).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec python3 scripts/demo.py "$@"
