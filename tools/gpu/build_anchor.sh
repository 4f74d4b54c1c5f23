#!/usr/bin/env bash
# Builds the public anchor, fast-ulysses, from its sdist into a private directory so that
# tools/gpu/bench_ulysses.py can run it side by side with fastcomms (a benchmark baseline, never a
# dependency of the library). The GPU machine has no registry: put the sdist and a setuptools>=77
# wheel under .anchor/ (git-ignored) and carry that folder there, e.g.
#   pip download --no-deps -d .anchor 'setuptools>=77'
#   curl -L -o .anchor/fast_ulysses-0.2.1.tar.gz <the sdist's URL on pypi.org/simple/fast-ulysses>
# Prints the directory to put on PYTHONPATH; exits 77 when .anchor/ holds no sdist.
set -euo pipefail
cd "$(dirname "$0")/../.."
sdist=$(ls .anchor/fast_ulysses-*.tar.gz 2>/dev/null | sort | tail -1 || true)
if [ -z "$sdist" ]; then
  echo "build_anchor: no .anchor/fast_ulysses-*.tar.gz; the anchor columns are left out" >&2
  exit 77
fi
site=${ANCHOR_SITE:-$PWD/build-anchor}
if [ ! -d "$site/pkg/fast_ulysses" ]; then
  python3 -m pip install -q --no-index --find-links .anchor --target "$site/tools" 'setuptools>=77' >&2
  # Against the torch already installed (the package refuses build isolation), sm_90 only.
  PYTHONPATH="$site/tools" FAST_ULYSSES_CUDA_ARCH=${FAST_ULYSSES_CUDA_ARCH:-90} \
    FAST_ULYSSES_BUILD_DIR="$site/build" \
    python3 -m pip install -q --no-index --no-build-isolation --no-deps --target "$site/pkg" "$sdist" >&2
fi
echo "$site/pkg"
