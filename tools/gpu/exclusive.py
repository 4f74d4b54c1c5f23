# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Runs a benchmark command only when the GPUs are idle, samples them while it runs, and says
EXCLUSIVE or CONTENDED at the end (a CONTENDED number is not to be reported).

Usage: python3 tools/gpu/exclusive.py [--wait S] -- COMMAND...

Before: waits up to --wait seconds (default 60) until no compute process is on any GPU and
utilization reads 0% twice in a row. During: every 0.2 s, lists the compute processes on the GPUs;
any process outside the command's own process group makes the run CONTENDED. The command's exit
code is passed through."""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    flag = "--query-gpu" if kind == "gpu" else "--query-compute-apps"
    out = subprocess.run(
        ["nvidia-smi", f"{flag}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def busy() -> bool:
    apps = smi("pid", "apps")
    util = [int(r[0]) for r in smi("utilization.gpu") if r and r[0].isdigit()]
    return bool(apps) or any(u > 0 for u in util)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wait", type=float, default=60.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command")
    deadline = time.time() + args.wait
    idle_reads = 0
    while idle_reads < 2 and time.time() < deadline:
        idle_reads = 0 if busy() else idle_reads + 1
        time.sleep(0.5)
    waited_out = idle_reads < 2
    proc = subprocess.Popen(cmd, start_new_session=True)
    pgid = os.getpgid(proc.pid)
    foreign: set[str] = set()
    stop = threading.Event()

    # Under tools/gpu/mps.sh the command's CUDA processes reach the GPU through the MPS server
    # that script started for it (its pipe folder is in our environment): that server is ours.
    own_mps = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))

    def sample() -> None:
        while not stop.is_set():
            for row in smi("pid,process_name", "apps"):
                if own_mps and len(row) > 1 and row[1].endswith("nvidia-cuda-mps-server"):
                    continue
                try:
                    if os.getpgid(int(row[0])) == pgid:
                        continue
                except ProcessLookupError:
                    continue  # gone between the listing and the lookup (one of ours exiting)
                except (ValueError, PermissionError):
                    pass
                foreign.add(",".join(row))
            stop.wait(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(pgid, signal.SIGTERM)
        rc = proc.wait()
    stop.set()
    t.join()
    if waited_out or foreign:
        why = "GPUs were busy before the run" if waited_out else ""
        if foreign:
            why += ("; " if why else "") + "other processes: " + "; ".join(sorted(foreign))
        print(f"CONTENDED ({why})", flush=True)
    else:
        print("EXCLUSIVE (no other compute process on the GPUs before or during the run)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
