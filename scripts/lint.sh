#!/usr/bin/env bash
# The one formatting entry point: clang-format and ruff through pre-commit.
#   bash scripts/lint.sh          format every tracked file in place
#   bash scripts/lint.sh --check  fail (and show the diff) if anything would change
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
export PATH="$FASTCOMMS_VENV/bin:$PATH"
if [ "${1:-}" = "--check" ]; then
  if ! pre-commit run --all-files --show-diff-on-failure; then
    echo "lint: files are not formatted; run: bash scripts/lint.sh" >&2
    exit 1
  fi
else
  pre-commit run --all-files || true
  echo "lint: done (re-run with --check to verify)"
fi
