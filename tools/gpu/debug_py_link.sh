#!/usr/bin/env bash
# Diagnoses how the Python extension and the core library were compiled and bound on the GPU
# machine (compile flags of both sides, where each of the core library's symbols bound at run
# time). Needs scripts/gpu.sh to have built the extension into build-gpu first.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${FASTCOMMS_GPU_BUILD:-build-gpu}
L=$B/python/fastcomms/libfastcomms.so
NCCL_HOME=${NCCL_HOME:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
export LD_LIBRARY_PATH="$NCCL_HOME/lib:${LD_LIBRARY_PATH:-}" PYTHONPATH="$PWD/$B/python:$PWD/python"
python3 -c 'import torch; print("torch abi", torch._C._GLIBCXX_USE_CXX11_ABI)'
g++ --version | head -1
grep -E '^CMAKE_(CXX|CUDA)_(COMPILER|FLAGS)[:_]' "$B/CMakeCache.txt"
echo "--- core compile"; ninja -C "$B" -t commands fastcomms | grep 'communicator.cpp' | head -1 | tr ' ' '\n' | grep -E '^-[DfOsgm]|std' | sort -u | tr '\n' ' '; echo
echo "--- binding compile"; ninja -C "$B" -t commands _C | grep 'binding.cpp' | head -1 | tr ' ' '\n' | grep -E '^-[DfOsgm]|std' | sort -u | tr '\n' ' '; echo
cmp "$L" "$B/libfastcomms.so" && echo "copy identical"
echo "std symbols defined in core: $(nm -D --defined-only "$L" | grep -c ' [TWV] _ZNS')"
rm -f /tmp/ldd.*
LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ldd timeout 60 python3 tools/gpu/py_nccl_smoke.py 0 1 /tmp/fc_s1
echo "rc=$?"
echo "--- bindings from the core library to anything but libc/libstdc++/cudart/nccl/libgcc/libm"
grep -h "file=.*libfastcomms.so" /tmp/ldd.* | grep -v "normal symbol" | head -3
grep -h "binding file [^ ]*libfastcomms.so" /tmp/ldd.* |
  grep -v "to /lib/x86_64-linux-gnu/\(libc\|libstdc++\|libgcc_s\|libm\)\.so\|libcudart\|libnccl\|to [^ ]*libfastcomms" | head -40
echo "--- where ostream bound"; grep -h "_ZNSolsEi\|_ZNSo9_M_insertIlEERSoT_\|_ZNSt7__cxx1119basic_ostringstream" /tmp/ldd.* | head -10
