#!/usr/bin/env bash
# The main job: set up, build, and run the fastcomms command (the Python package's console
# script, the same as `fastcomms ...` from an installed wheel), e.g.
#   bash scripts/run.sh bench                # the best backend present, a size sweep
#   bash scripts/run.sh check --backend gloo --nproc 4
#   bash scripts/run.sh doctor --preflight
# On a machine with GPUs the build picks up nvcc and NCCL's headers (the CUDA toolkit whose major
# version matches torch's CUDA, and NCCL from torch's nvidia-nccl package or NCCL_HOME); without
# them the CPU build runs the gloo backend.
set -euo pipefail
source "$(dirname "$0")/common.sh"
bash "$FASTCOMMS_ROOT/scripts/setup.sh"
bash "$FASTCOMMS_ROOT/scripts/build.sh" >/dev/null
export PYTHONPATH="$FASTCOMMS_BUILD/python:$FASTCOMMS_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$FASTCOMMS_VENV/bin/python" -m fastcomms "$@"
