#!/usr/bin/env bash
# The main job: set up, build, and run the fastcomms CLI, e.g.
#   bash scripts/run.sh bench --backend gloo --nproc 4
set -euo pipefail
source "$(dirname "$0")/common.sh"
bash "$FASTCOMMS_ROOT/scripts/setup.sh"
bash "$FASTCOMMS_ROOT/scripts/build.sh" >/dev/null
exec "$FASTCOMMS_BUILD/tools/fastcomms" "$@"
