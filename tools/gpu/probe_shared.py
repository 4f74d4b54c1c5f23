# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Where a run of ranks sharing one GPU gets stuck: each rank logs every step with its time and,
after --hang seconds, dumps its Python stack and exits (faulthandler), so a hang under a new
setting (e.g. tools/gpu/mps.sh) shows its place instead of eating a device call.

Usage: python3 tools/gpu/probe_shared.py [--nproc 2] [--hang 30] [--sizes 2048,65536]"""

import argparse
import faulthandler
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch


def _rank(rank, size, path, hang, sizes):
    import torch.distributed as dist

    faulthandler.dump_traceback_later(hang, exit=True)
    t0 = time.perf_counter()

    def log(what):
        t = time.perf_counter() - t0
        print(f"[rank {rank}] {t:7.3f} s {what}", file=sys.stderr, flush=True)

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    log("CUDA context")
    dist.init_process_group("gloo", store=dist.FileStore(path, size), rank=rank, world_size=size)
    log("gloo group")
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(None, device=dev, transport="nvlink")
    log(f"UlyssesGroup: {g.transport} ({g.transport_reason})")
    x = torch.randn(1, 256, 2 * size, 128, device=dev, dtype=torch.bfloat16)
    for i in range(3):
        y = g.all_to_all_4d(x)
        torch.cuda.synchronize()
        log(f"call {i} copy {tuple(y.shape)}")
    z = g.empty_output(x)
    for i in range(3):
        g.all_to_all_4d(x, out=z)
        torch.cuda.synchronize()
        log(f"call {i} zero copy")
    t = time.perf_counter()
    for _ in range(50):
        g.all_to_all_4d(x, out=z)
    torch.cuda.synchronize()
    log(f"50 zero-copy calls: {(time.perf_counter() - t) / 50 * 1e6:.1f} us per call")
    for s in sizes:  # larger grids: one KV head replicated to every rank, and plain heads
        for h, kv in ((1, size), (size, 1)):
            x = torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16)
            z = g.empty_output(x, kv_replicas=kv)
            for name, fn in (
                ("copy", lambda x=x, kv=kv: g.all_to_all_4d(x, kv_replicas=kv)),
                ("zero copy", lambda x=x, kv=kv, z=z: g.all_to_all_4d(x, kv_replicas=kv, out=z)),
                ("repeat + copy", lambda x=x, kv=kv: g.all_to_all_4d(x.repeat_interleave(kv, 2))),
            ):
                t = time.perf_counter()
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                us = (time.perf_counter() - t) / 10 * 1e6
                log(f"(1,{s},{h},128) kv_replicas={kv} {name}: {us:.1f} us per call")
    g.destroy()
    dist.destroy_process_group()
    log("done")
    faulthandler.cancel_dump_traceback_later()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hang", type=float, default=30.0)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 65536])
    a = ap.parse_args()
    print(f"probe_shared: MPS pipe {os.environ.get('CUDA_MPS_PIPE_DIRECTORY', 'none')}", flush=True)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        ps = [
            ctx.Process(target=_rank, args=(r, a.nproc, os.path.join(d, "s"), a.hang, a.sizes))
            for r in range(a.nproc)
        ]
        for p in ps:
            p.start()
        for p in ps:
            p.join(a.hang + 10)
            if p.exitcode is None:
                p.kill()
    codes = [p.exitcode for p in ps]
    print(f"probe_shared: exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
