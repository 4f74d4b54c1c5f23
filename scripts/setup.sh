#!/usr/bin/env bash
# Installs everything the build and the tests need; quick when it is already there.
#   Debian packages: compilers, CMake, Ninja, GoogleTest, Gloo, clang (libFuzzer), clang-format.
#   A Python venv ($FASTCOMMS_VENV) with the pinned tools of requirements-dev.txt.
# FASTCOMMS_OFFLINE=1 (a machine with no package registry, e.g. a GPU machine whose image already
# has torch, pybind11, rich, CMake, Ninja and a compiler): installs nothing; the venv sees the
# system Python's packages, and what is missing is named.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"

if [ "${FASTCOMMS_OFFLINE:-0}" = 1 ]; then
  for tool in cmake ninja g++ python3; do
    command -v "$tool" >/dev/null || { echo "setup (offline): $tool is missing and cannot be installed here" >&2; exit 1; }
  done
  if [ ! -x "$FASTCOMMS_VENV/bin/python" ]; then
    step "python venv at $FASTCOMMS_VENV over the system packages (offline)"
    python3 -m venv --system-site-packages --without-pip "$FASTCOMMS_VENV"
    # python3 may itself be a venv, whose packages a venv made from it does not see: name them.
    site=$("$FASTCOMMS_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/fastcomms-offline.pth"
  fi
  "$FASTCOMMS_VENV/bin/python" - <<'PY'
import importlib.util, sys
need = ["torch", "pybind11", "rich", "numpy"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"setup (offline): Python modules missing and not installable here: {', '.join(missing)}")
PY
  exit 0
fi

APT_PACKAGES=(cmake ninja-build g++ libgtest-dev libgmock-dev clang libclang-rt-14-dev
              clang-format python3-venv libgloo-dev libssl-dev
              iproute2)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  step "apt-get install ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

stamp="$FASTCOMMS_VENV/.fastcomms-requirements"
want=$(cat requirements-dev.txt)
if [ ! -x "$FASTCOMMS_VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "python venv at $FASTCOMMS_VENV"
  python3 -m venv "$FASTCOMMS_VENV"
  "$FASTCOMMS_VENV/bin/pip" install -q --upgrade pip
  "$FASTCOMMS_VENV/bin/pip" install -q -r requirements-dev.txt
  printf '%s' "$want" >"$stamp"
fi
