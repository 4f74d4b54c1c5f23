# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A developer probe (not a test): the copy engines' flat peer-copy rate by size, into a peer
buffer mapped two ways, both ranks copying at once (both directions busy):

  ipc   a cudaMalloc'd buffer opened with legacy CUDA IPC (cudaIpcOpenMemHandle; what torch's
        multiprocessing sharing and fastcomms' windows use)
  vmm   torch symmetric memory (cuMemCreate + cuMemMap of an imported handle)

One cudaMemcpyAsync (torch copy_ of contiguous bytes) per call, CUDA events, median of 7
interleaved rounds. Usage: python3 tools/gpu/probe_peer_copy.py
"""

import os
import statistics
import sys
import tempfile

import torch
import torch.multiprocessing as mp

SIZES_MIB = [16, 64, 128, 185, 256, 553]


def _rank(rank, path, qs, out):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", store=dist.FileStore(path, 2), rank=rank, world_size=2, device_id=dev
    )
    peer = 1 - rank
    top = max(SIZES_MIB) << 20
    src = torch.randint(0, 255, (top,), dtype=torch.uint8, device=dev)
    mine = torch.empty(top, dtype=torch.uint8, device=dev)  # its own cudaMalloc segment
    qs[rank].put(mine)
    ipc = qs[peer].get()  # the peer's buffer through legacy CUDA IPC (on the peer's device)
    sym = symm_mem.empty(top, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(sym, group=dist.group.WORLD)
    vmm = hdl.get_buffer(peer, (top,), torch.uint8)
    dist.barrier()
    rows = []
    for mib in SIZES_MIB:
        n = mib << 20
        samples = {"ipc": [], "vmm": []}
        targets = {"ipc": ipc, "vmm": vmm}
        for _ in range(3):
            for t in targets.values():
                t[:n].copy_(src[:n], non_blocking=True)
        for _ in range(7):
            for k, t in targets.items():
                dist.barrier()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(5):
                    t[:n].copy_(src[:n], non_blocking=True)
                b.record()
                b.synchronize()
                samples[k].append(a.elapsed_time(b) * 1e3 / 5)
        med = {k: statistics.median(v) for k, v in samples.items()}
        ok = torch.equal(vmm[:n].cpu(), src[:n].cpu())
        rows.append((mib, med["ipc"], med["vmm"], ok))
    out.put((rank, rows))
    dist.barrier()
    del ipc
    dist.destroy_process_group()


def main():
    if torch.cuda.device_count() < 2:
        print("SKIPPED: probe_peer_copy needs 2 GPUs")
        return 0
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    qs, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_rank, args=(r, os.path.join(d, "s"), qs, out)) for r in range(2)
        ]
        for p in procs:
            p.start()
        res = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
    print(f"{'MiB':>6s} {'ipc us':>9s} {'GB/s':>7s} {'vmm us':>9s} {'GB/s':>7s}  (slowest rank)")
    for i, (mib, _, _, _) in enumerate(res[0]):
        ipc = max(res[r][i][1] for r in res)
        vmm = max(res[r][i][2] for r in res)
        ok = all(res[r][i][3] for r in res)
        gb = (mib << 20) / 1e3
        flag = "ok" if ok else "BAD"
        print(f"{mib:6d} {ipc:9.1f} {gb / ipc:7.1f} {vmm:9.1f} {gb / vmm:7.1f}  {flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
