# Shared settings for the scripts (sourced, not run).
FASTCOMMS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The venv lives outside the checkout so that fresh clones (CI) reuse it; keyed by Python.
FASTCOMMS_VENV=${FASTCOMMS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fastcomms/venv-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
FASTCOMMS_BUILD=${FASTCOMMS_BUILD:-$FASTCOMMS_ROOT/build}
JOBS=${JOBS:-$(nproc)}
# Each step says the time it starts, so a slow CI run's log shows where its time went.
step() { printf '\n==> [%s] %s\n' "$(date -u +%T)" "$*"; }
