#!/usr/bin/env bash
# Configures (once) and builds the C++/CUDA tree and the Python extension (fastcomms._C, against
# the venv's torch) in $FASTCOMMS_BUILD (default ./build).
# CUDA is on when nvcc is found; FASTCOMMS_CUDA=OFF turns it off, FASTCOMMS_CUDA_ARCH picks
# the architectures (default 80;90 and 100 where the toolkit has it). NCCL's headers come from
# NCCL_HOME, else torch's nvidia-nccl package. FASTCOMMS_CXX names the host compiler for C++ and
# CUDA host code (use the one torch was built with where an image sets another $CXX: NOTE [system
# compiler] in scripts/gpu.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
export PATH="$PATH:/usr/local/cuda/bin"
args=(-G Ninja -DFASTCOMMS_PYTHON=ON -DPython3_EXECUTABLE="$FASTCOMMS_VENV/bin/python")
if [ -z "${NCCL_HOME:-}" ] && command -v nvcc >/dev/null; then
  NCCL_HOME=$("$FASTCOMMS_VENV/bin/python" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
  export NCCL_HOME
fi
if [ -n "${FASTCOMMS_CXX:-}" ]; then
  export CXX="$FASTCOMMS_CXX" CUDAHOSTCXX="$FASTCOMMS_CXX"
  args+=(-DCMAKE_CXX_COMPILER="$FASTCOMMS_CXX" -DCMAKE_CUDA_HOST_COMPILER="$FASTCOMMS_CXX")
fi
[ -n "${FASTCOMMS_CUDA:-}" ] && args+=("-DFASTCOMMS_CUDA=$FASTCOMMS_CUDA")
if [ ! -f "$FASTCOMMS_BUILD/build.ninja" ] || [ -n "${FASTCOMMS_CUDA:-}" ] ||
   ! grep -q "FASTCOMMS_PYTHON:BOOL=ON" "$FASTCOMMS_BUILD/CMakeCache.txt"; then
  step "configure $FASTCOMMS_BUILD"
  cmake -S . -B "$FASTCOMMS_BUILD" "${args[@]}" >/dev/null
fi
step "build ($JOBS jobs)"
cmake --build "$FASTCOMMS_BUILD" -j "$JOBS"
