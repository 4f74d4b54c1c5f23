#!/usr/bin/env bash
# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
# Runs COMMAND with its CUDA processes as clients of a private MPS (Multi-Process Service) daemon,
# started for it and stopped after it.
#
# Usage: tools/gpu/mps.sh COMMAND...   (tests/python/test_ulysses_gpu.py keeps it up with `sleep`)
#
# Why: ranks that share a GPU as separate processes are time-sliced without MPS: one process's
# kernels run while the others wait for the scheduler, so a device-side wait for a peer on the
# same GPU lasts until the next context switch and a benchmark of several ranks per GPU times the
# slicing, not the transfer. Under MPS the processes' kernels run side by side, as ranks on
# separate GPUs do. MPS changes no GPU setting (compute mode, clocks and MIG stay as they are):
# the daemon and its pipes live in a fresh temporary folder, and only processes that see this
# script's CUDA_MPS_PIPE_DIRECTORY use it. Exit codes: the command's, or 3 when MPS cannot start.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 COMMAND..." >&2; exit 2; }
command -v nvidia-cuda-mps-control >/dev/null || {
  echo "mps.sh: nvidia-cuda-mps-control is not on PATH" >&2
  exit 3
}
# FASTCOMMS_MPS_DIR: the folder to use (a test that starts its own clients later sets it and waits
# for $FASTCOMMS_MPS_DIR/pipe/control); removed at the end either way.
dir=${FASTCOMMS_MPS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fastcomms-mps.XXXXXX")}
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
before=$(pgrep -d, -f 'nvidia-cuda-mps-(control|server)' || true)
stop() {
  [ -n "${child:-}" ] && kill -KILL -- "-$child" 2>/dev/null  # clients first: quit waits for them
  timeout 3 nvidia-cuda-mps-control <<<quit >/dev/null 2>&1
  # if quit did not end them: every MPS process that was not there before this script started
  for p in $(pgrep -f 'nvidia-cuda-mps-(control|server)'); do
    case ",$before," in *",$p,"*) ;; *) kill -KILL "$p" 2>/dev/null ;; esac
  done
  rm -rf "$dir"
}
if ! nvidia-cuda-mps-control -d; then
  echo "mps.sh: the MPS daemon did not start" >&2
  cat "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -5 >&2
  rm -rf "$dir"
  exit 3
fi
trap stop EXIT
trap 'exit 143' TERM INT
setsid "$@" &  # its own process group, so stop() can end every client
child=$!
wait "$child"
rc=$?
child=
if [ "$rc" != 0 ]; then  # the server's own log says why a client was refused
  tail -5 "$CUDA_MPS_LOG_DIRECTORY"/server.log 2>/dev/null | sed 's/^/mps server: /' >&2
fi
exit "$rc"
