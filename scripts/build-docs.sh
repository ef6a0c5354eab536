#!/usr/bin/env bash
# Build the docs site strictly: any warning (broken link, missing anchor, page not in the nav, an API
# reference to a name that does not exist) fails the build. Output goes to a temporary directory unless
# one is given.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-}"
if [ -z "$out" ]; then
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
fi
# Not --quiet: it hides warnings from mkdocs' strict-mode counter, so a broken link would pass. INFO lines
# are filtered instead (pipefail keeps mkdocs' exit status). mkdocs-material prints a banner about its
# future on every build; it is not a warning about our docs.
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$out" 2>&1 | { grep -v -E '^INFO ' || true; }
echo "docs: built strictly (mkdocs build --strict)"
