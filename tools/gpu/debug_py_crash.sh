#!/usr/bin/env bash
# Runs tools/gpu/py_nccl_smoke.py on two ranks under cuda-gdb (the GPU machine has no gdb) with
# the core library loaded each way, writing a native backtrace per rank to $OUT/gdb_MODE_RANK.log.
# Needs scripts/gpu.sh to have built the extension into build-gpu first.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-out}
NCCL_HOME=${NCCL_HOME:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
export LD_LIBRARY_PATH="$NCCL_HOME/lib:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$PWD/${FASTCOMMS_GPU_BUILD:-build-gpu}/python:$PWD/python"
for mode in ${MODES:-deepbind local}; do
  rm -f "/tmp/fc_smoke_$mode"
  for r in 0 1; do
    FASTCOMMS_LOAD_MODE=$mode timeout 150 cuda-gdb -q -batch -ex 'set pagination off' \
      -ex 'set print thread-events off' -ex run -ex bt -ex 'info threads' \
      --args python3 tools/gpu/py_nccl_smoke.py "$r" 2 "/tmp/fc_smoke_$mode" \
      >"$OUT/gdb_${mode}_$r.log" 2>&1 &
  done
  wait
  for r in 0 1; do
    echo "=== $mode rank $r"
    grep -v '^\[New \|^\[Thread\|^warning: \|^Reading symbols\|libthread_db' "$OUT/gdb_${mode}_$r.log" | tail -45
  done
done
