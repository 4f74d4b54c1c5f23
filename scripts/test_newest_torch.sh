#!/usr/bin/env bash
# CI's second torch (NOTE [one torch per build]): scripts/test.sh builds and tests everything on the
# oldest supported torch (requirements-dev.txt); this builds the wheel against the newest
# (requirements-torch-newest.txt, its own venv), runs the release gate on it, runs the tests that
# touch torch's private or fast-moving APIs against that build (the version checks, torchcomms
# parity, the gloo communicator, launchers, torch's torchcomms switch, DeviceMesh, Ulysses,
# compile, distwrap), and the console script's bench from the installed wheel.
#   FASTCOMMS_NEWEST_TESTS overrides the test files (space separated, under tests/python).
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
want=$(grep -E '^torch==' requirements-torch-newest.txt | cut -d= -f3)
venv="$FASTCOMMS_VENV-torch$want"
stamp="$venv/.fastcomms-requirements"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$(cat requirements-torch-newest.txt)" ]; then
  step "python venv at $venv (torch $want)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r requirements-torch-newest.txt
  cat requirements-torch-newest.txt >"$stamp"
fi

step "wheel against torch $want: build it and run the release gate on it (the package as users get it)"
# scripts/wheel.sh: the same CMake project through scikit-build-core (CPU-only here to keep CI
# short; its build folder persists), the gloo backend's system libraries bundled, the torch pin
# checked, then tools/wheel_gate.py: metadata, every ELF's needed libraries and exports, an install
# into a fresh folder, and `fastcomms check` from there.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHON="$venv/bin/python" FASTCOMMS_CUDA=0 bash scripts/wheel.sh "$work/dist"

tests=${FASTCOMMS_NEWEST_TESTS:-"test_torch_compat.py test_version.py test_parity_modules.py
  test_comm_gloo.py test_launch.py test_torch_switch.py test_device_mesh.py test_ulysses_gloo.py
  test_compiled_methods.py test_distwrap.py test_imports.py"}
step "pytest on torch $want: $(echo $tests)"
files=()
for t in $tests; do files+=("tests/python/$t"); done
mm=$(echo "$want" | cut -d. -f1,2)
PYTHONPATH="$FASTCOMMS_BUILD-wheel-cudaOFF-torch$mm/python:$FASTCOMMS_ROOT/python" \
  "$venv/bin/python" -m pytest -q -rs "${files[@]}"

step "the console script's bench from the installed wheel (torch $want)"
"$venv/bin/pip" install -q --no-deps --target "$work/site" "$work"/dist/fastcomms-*.whl
(cd "$work" && PYTHONPATH="$work/site" "$venv/bin/python" -m fastcomms bench --nproc 2 \
  --shape 1,64,8,16 --iters 3 --rounds 2 --warmup 1 --no-progress)
