#!/usr/bin/env bash
# Sets up, builds and runs every test that can run on this machine:
#   formatting check, the plan fuzzer (clang + libFuzzer, a bounded run), ctest (plan replay,
#   validation messages, core, gloo, ...; GPU tests say SKIPPED without GPUs), then pytest (the
#   Python package over gloo against torch.distributed), all on the oldest supported torch; then
#   scripts/test_newest_torch.sh: the wheel, its gate and the tests on torch's moving parts on the
#   newest supported torch.
# FUZZ_SECONDS (default 20) and FUZZ_CALLS_SECONDS (default 10) bound the fuzzers; FASTCOMMS_SEED replays a random test run.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
bash scripts/setup.sh

step "format check, version"
bash scripts/lint.sh --check
bash scripts/check_version.sh

# Without a GPU (CI) one architecture is enough to compile every CUDA source once: nothing runs
# it here, and the GPU machine builds its own (scripts/gpu.sh). A third of the nvcc time.
if ! nvidia-smi -L >/dev/null 2>&1; then
  export FASTCOMMS_CUDA_ARCH=${FASTCOMMS_CUDA_ARCH:-90}
fi
bash scripts/build.sh

step "fuzz: plan (${FUZZ_SECONDS:-20} s), calls and ipc records (${FUZZ_CALLS_SECONDS:-10} s each)"
fuzz_build="$FASTCOMMS_BUILD-fuzz"
if [ ! -f "$fuzz_build/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_build" -G Ninja -DFASTCOMMS_CUDA=OFF \
    -DFASTCOMMS_FUZZ=ON -DFASTCOMMS_TOOLS=OFF -DFASTCOMMS_TESTS=ON >/dev/null
fi
cmake --build "$fuzz_build" --target fuzz_plan fuzz_calls fuzz_records -j "$JOBS" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in fuzz_plan fuzz_calls fuzz_records; do
  seconds=${FUZZ_SECONDS:-20}
  [ "$target" != fuzz_plan ] && seconds=${FUZZ_CALLS_SECONDS:-10}
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

# The wheel, its gate and the console script are built and run against the newest supported torch,
# with the tests that touch torch's moving parts (everything above ran on the oldest).
bash scripts/test_newest_torch.sh
