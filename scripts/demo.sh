#!/usr/bin/env bash
# The main job: set up, build, and run the Ulysses layout demo. Arguments go to the demo, e.g.
#   bash scripts/demo.sh --world 4 --shape 1,4096,40,128 --dtype bfloat16
set -euo pipefail
source "$(dirname "$0")/common.sh"
bash "$FASTCOMMS_ROOT/scripts/setup.sh"
bash "$FASTCOMMS_ROOT/scripts/build.sh" >/dev/null
step "fastcomms-plan-demo $*"
exec "$FASTCOMMS_BUILD/tools/fastcomms-plan-demo" "$@"
