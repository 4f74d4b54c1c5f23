#!/usr/bin/env bash
# Installs everything the build and the tests need; quick when it is already there.
#   Debian packages: compilers, CMake, Ninja, GoogleTest, Gloo, clang (libFuzzer), clang-format.
#   A Python venv ($FASTCOMMS_VENV) with the pinned tools of requirements-dev.txt.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$FASTCOMMS_ROOT"

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
