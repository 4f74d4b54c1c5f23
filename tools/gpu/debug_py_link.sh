#!/usr/bin/env bash
# Diagnoses a crash of the Python extension on the GPU machine: how the core library was linked
# (the link line, the std:: symbols it defines, the environment's compiler flags) and whether the
# one-rank smoke check (tools/gpu/py_nccl_smoke.py) passes for a few build variants.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_HOME=${NCCL_HOME:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
export NCCL_HOME LD_LIBRARY_PATH="$NCCL_HOME/lib:${LD_LIBRARY_PATH:-}"
env | grep -iE 'flags|^cc=|^cxx=|cuda_host|^ld_|^path=' | cut -c1-300
SYS_CXX=$(command -v /usr/bin/g++ || command -v g++)
variant() {  # name, extra cmake args...
  local name=$1 B=build-dbg-$1; shift
  cmake -S . -B "$B" -G Ninja -DFASTCOMMS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$SYS_CXX" -DCMAKE_CUDA_HOST_COMPILER="$SYS_CXX" \
    -DFASTCOMMS_PYTHON=ON -DFASTCOMMS_TESTS=OFF -DFASTCOMMS_TOOLS=OFF \
    -DPython3_EXECUTABLE="$(command -v python3)" "$@" >"$B.cfg.log" 2>&1 &&
    cmake --build "$B" -j "$(nproc)" --target _C >"$B.build.log" 2>&1 || { echo "$name: build failed"; tail -5 "$B.build.log"; return; }
  local L=$B/python/fastcomms/libfastcomms.so
  echo "=== $name: std symbols defined $(nm -D --defined-only "$L" | grep -c ' [TWVBDR] _ZNS\| [TWVBDR] _ZNKS\| [TWVBDR] _ZTVS')"
  echo "link: $(ninja -C "$B" -t commands fastcomms | tail -1 | tr ' ' '\n' | grep -vE '\.o$' | tr '\n' ' ' | cut -c1-600)"
  nm -D --defined-only -C "$L" | grep -E ' (std::locale|std::num_put|std::basic_ostream|std::ios_base)' | head -5
  PYTHONPATH="$PWD/$B/python:$PWD/python" timeout 60 python3 tools/gpu/py_nccl_smoke.py 0 1 "/tmp/fc_$name" 2>&1 | tail -3
}
variant base
variant cudart_shared -DCMAKE_CUDA_RUNTIME_LIBRARY=Shared
variant exclude_libs -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
