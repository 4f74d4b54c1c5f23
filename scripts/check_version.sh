#!/usr/bin/env bash
# The release gate's version rule: VERSION holds one version literal (read by CMake, pyproject and
# the package); when HEAD carries a release tag (vX.Y.Z or X.Y.Z), the tag must say the same.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(head -1 VERSION)
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+([.-]?[A-Za-z0-9.]+)?$ ]] || {
  echo "VERSION: '$version' is not a version (X.Y.Z[suffix])" >&2
  exit 1
}
tags=$(git tag --points-at HEAD 2>/dev/null | grep -E '^v?[0-9]' || true)
for t in $tags; do
  if [ "${t#v}" != "$version" ]; then
    echo "release tag $t does not match VERSION $version" >&2
    exit 1
  fi
done
echo "version $version${tags:+ (tag $tags)}"
