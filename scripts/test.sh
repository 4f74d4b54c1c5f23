#!/usr/bin/env bash
# Sets up, builds and runs every test that can run on this machine:
#   formatting check, the plan fuzzer (clang + libFuzzer, a bounded run), ctest (plan replay,
#   validation messages, core, gloo, ...; GPU tests say SKIPPED without GPUs), then pytest (the
#   Python package over gloo against torch.distributed).
# FUZZ_SECONDS (default 20) and FUZZ_CALLS_SECONDS (default 10) bound the fuzzers; FASTCOMMS_SEED replays a random test run.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
bash scripts/setup.sh

step "format check, version"
bash scripts/lint.sh --check
bash scripts/check_version.sh

bash scripts/build.sh

step "fuzz: plan (${FUZZ_SECONDS:-20} s), calls (${FUZZ_CALLS_SECONDS:-10} s)"
fuzz_build="$FASTCOMMS_BUILD-fuzz"
if [ ! -f "$fuzz_build/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_build" -G Ninja -DFASTCOMMS_CUDA=OFF \
    -DFASTCOMMS_FUZZ=ON -DFASTCOMMS_TOOLS=OFF -DFASTCOMMS_TESTS=ON >/dev/null
fi
cmake --build "$fuzz_build" --target fuzz_plan fuzz_calls -j "$JOBS" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in fuzz_plan fuzz_calls; do
  seconds=${FUZZ_SECONDS:-20}
  [ "$target" = fuzz_calls ] && seconds=${FUZZ_CALLS_SECONDS:-10}
  mkdir -p "$work/$target"
  if ! (cd "$work/$target" && "$fuzz_build/tests/fuzz/$target" -max_total_time="$seconds" \
        -print_final_stats=1 . >fuzz.log 2>&1); then
    tail -n 40 "$work/$target/fuzz.log"
    echo "fuzz: $target failed; the crashing input is printed above" >&2
    exit 1
  fi
  echo "$target: $(grep -E "^Done" "$work/$target/fuzz.log")"
done

step "plan replay summary"
"$FASTCOMMS_BUILD/tests/host/test_plan" --gtest_filter='PlanReplay.RandomGeometries*' \
  | grep -E '^\[plan replay\]|FAILED|Failure' || true

step "ctest"
ctest --test-dir "$FASTCOMMS_BUILD" --output-on-failure -j "$JOBS"

step "pytest (the Python package on CPU over gloo, against torch.distributed)"
PYTHONPATH="$FASTCOMMS_BUILD/python:$FASTCOMMS_ROOT/python" \
  "$FASTCOMMS_VENV/bin/python" -m pytest -q -rs tests/python

step "pip: build the wheel, install it, use it (the package as users get it)"
# The same CMake project through scikit-build-core, CPU-only here to keep CI short; its build
# folder persists ($FASTCOMMS_BUILD-wheel), so a rerun rebuilds only what changed.
"$FASTCOMMS_VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/wheel" . \
  -C build-dir="$FASTCOMMS_BUILD-wheel" -C cmake.define.FASTCOMMS_CUDA=OFF
"$FASTCOMMS_VENV/bin/pip" install -q --no-deps --target "$work/site" "$work"/wheel/fastcomms-*.whl
(cd "$work" && PYTHONPATH="$work/site" "$FASTCOMMS_VENV/bin/python" -c '
import sys, fastcomms
assert fastcomms.__file__.startswith(sys.argv[1]), fastcomms.__file__
print("installed:", fastcomms.__file__, "backends:", fastcomms.built_backends())
' "$work/site" &&
  PYTHONPATH="$work/site" "$FASTCOMMS_VENV/bin/python" -m fastcomms bench --nproc 2 \
    --shape 1,64,8,16 --iters 3 --warmup 1)
