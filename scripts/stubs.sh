#!/usr/bin/env bash
# Regenerates python/fastcomms/_C.pyi, the type stub of the extension module, from the built
# extension (pybind11-stubgen, installed on demand in the venv). Run after changing the binding;
# tests/python/test_typing.py (run by scripts/test.sh) type-checks examples/typed_usage.py against
# the committed stub with mypy.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
"$FASTCOMMS_VENV/bin/python" -c 'import pybind11_stubgen' 2>/dev/null ||
  "$FASTCOMMS_VENV/bin/pip" install -q pybind11-stubgen==3.0.0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
PYTHONPATH="$FASTCOMMS_BUILD/python:$FASTCOMMS_ROOT/python" \
  "$FASTCOMMS_VENV/bin/pybind11-stubgen" fastcomms._C -o "$out" --exit-code
# The extension's ValueError/TypeError/TimeoutError subclass the builtins of the same name.
sed -e 's/^class \(ValueError\|TypeError\|TimeoutError\)(\1, RuntimeError):/class \1(builtins.\1, builtins.RuntimeError):/' \
    -e 's/^import collections.abc$/import builtins\nimport collections.abc/' \
    "$out/fastcomms/_C.pyi" >python/fastcomms/_C.pyi
echo "wrote python/fastcomms/_C.pyi"
