#!/usr/bin/env bash
# Builds the fastcomms wheel and runs the release gate on it (docs/release.md).
#   bash scripts/wheel.sh [OUTDIR]          (default: dist/)
# CUDA is on where nvcc is found (FASTCOMMS_CUDA=0 turns it off); FASTCOMMS_CUDA_ARCH picks the
# GPU architectures (default "80;90;100"). The wheel pins torch==X.Y.* of the torch it was built
# against (the build writes it: tools/build/torch_requirement.py; the gate checks it); the system libraries the gloo backend needs are bundled by auditwheel (torch's, CUDA's
# and NCCL's are not: torch brings them). GATE_BACKEND (default: gloo without CUDA, auto with it)
# is the backend `fastcomms check` runs on from the installed wheel, with GATE_NPROC ranks
# (default 2; 1 on a machine with one GPU).
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$FASTCOMMS_VENV/bin/python" ]; then PY=$FASTCOMMS_VENV/bin/python; else PY=$(command -v python3); fi
fi
out=${1:-$FASTCOMMS_ROOT/dist}
cuda=OFF
if [ "${FASTCOMMS_CUDA:-1}" != 0 ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  cuda=ON
  export PATH="$PATH:/usr/local/cuda/bin"
fi
export FASTCOMMS_CUDA_ARCH=${FASTCOMMS_CUDA_ARCH:-80;90;100}
torch_mm=$("$PY" -c 'import torch; print(".".join(torch.__version__.split("+")[0].split(".")[:2]))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
archs=$([ $cuda = ON ] && echo " (architectures $FASTCOMMS_CUDA_ARCH)" || true)
echo "wheel: CUDA $cuda$archs, torch $torch_mm, $("$PY" --version)"
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/raw" . \
  -C build-dir="$FASTCOMMS_BUILD-wheel-cuda$cuda-torch$torch_mm" -C cmake.define.FASTCOMMS_CUDA=$cuda
# Bundle the gloo backend's system libraries (libgloo and what it needs), nothing of torch's.
PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair -w "$work/repaired" \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcudart.so.*' \
  --exclude 'libnccl.so.*' --exclude 'libcuda.so.*' --exclude 'libnvidia-ml.so.*' \
  "$work"/raw/fastcomms-*.whl >"$work/auditwheel.log" 2>&1 || {
  cat "$work/auditwheel.log" >&2
  exit 1
}
rm -f "$out"/fastcomms-*.whl
mkdir -p "$out"
cp "$work"/repaired/fastcomms-*.whl "$out"/
wheel=$(ls "$out"/fastcomms-*.whl)
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1))"
backend=${GATE_BACKEND:-$([ $cuda = ON ] && echo auto || echo gloo)}
"$PY" tools/wheel_gate.py check "$wheel" --torch "$torch_mm" --backend "$backend" \
  --nproc "${GATE_NPROC:-2}"
