# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A ring all-reduce written in Triton with the device window (docs/device_api.md).

One kernel per call, no host round trip between steps: a reduce-scatter ring (N - 1 steps, each
rank puts the chunk it just accumulated into its right neighbour's window and signals; the
neighbour waits, adds) and an all-gather ring (N - 1 steps of the reduced chunks), with
``fastcomms.triton``'s put_block / wait_signal_from_block / barrier_block. The result is checked
against torch: the sum of every rank's input, computed locally (integer-valued float32, so the
sum is exact in any order).

Run: ``python examples/device_window_triton.py --nproc 2`` (ranks on GPU ``rank % gpus``; ranks
that share a GPU need MPS, tools/gpu/mps.sh).
"""

import argparse
import datetime
import os
import tempfile

import fastcomms
import fastcomms.triton as fct
import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def ring_all_reduce(win, x_buf, x_ptr, chunk, call, BLOCK: tl.constexpr):
    """x (float32, n * chunk elements) becomes the sum over ranks. The window holds 2 * n chunks:
    [0, n) land the reduce-scatter steps, [n, 2n) the all-gather steps. Signals 0 and 1 count
    steps across calls (call * (n - 1) before this one), so nothing is reset."""
    r = fct.rank(win)
    n = fct.num_ranks(win)
    nxt = (r + 1) % n
    prev = (r + n - 1) % n
    land = fct.base(win).to(tl.pointer_type(tl.float32))
    cb = chunk * 4  # bytes per chunk
    done = call * (n - 1)
    fct.barrier_block(win, 0)  # every rank is done reading the window of the last call
    for s in range(0, n - 1):  # reduce-scatter
        c_send = (r - s + n) % n
        fct.put_block(win, c_send * cb, x_buf, c_send * cb, nxt, cb, 0, -1)
        fct.wait_signal_from_block(win, prev, 0, done + s + 1)
        c_recv = (r - s - 1 + n) % n
        for i in range(0, chunk, BLOCK):
            o = c_recv * chunk + i + tl.arange(0, BLOCK)
            m = i + tl.arange(0, BLOCK) < chunk
            tl.store(x_ptr + o, tl.load(x_ptr + o, mask=m) + tl.load(land + o, mask=m), mask=m)
        tl.debug_barrier()  # the sum is in x before the next put reads it
    for s in range(0, n - 1):  # all-gather: rank r owns chunk r + 1 now
        c_send = (r + 1 - s + n) % n
        fct.put_block(win, (n + c_send) * cb, x_buf, c_send * cb, nxt, cb, 1, -1)
        fct.wait_signal_from_block(win, prev, 1, done + s + 1)
        c_recv = (r - s + n) % n
        for i in range(0, chunk, BLOCK):
            o = c_recv * chunk + i + tl.arange(0, BLOCK)
            m = i + tl.arange(0, BLOCK) < chunk
            tl.store(x_ptr + o, tl.load(land + n * chunk + o, mask=m), mask=m)
        tl.debug_barrier()


def inputs(size, numel):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(-1000, 1000, (numel,), generator=g).float() for _ in range(size)]


def run(rank, size, path, numel, calls):
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    chunk = numel // size
    landing = torch.zeros(2 * size * chunk, dtype=torch.float32, device=dev)
    timeout = datetime.timedelta(seconds=60)
    if size <= torch.cuda.device_count():  # a GPU per rank: an nvlink communicator's window
        store = torch.distributed.FileStore(path, size)
        comm = fastcomms.new_comm("nvlink", dev, "ring", store=store, timeout=timeout)
        win = comm.new_window(landing)  # collective
    else:  # ranks share a GPU (MPS clients), which NCCL refuses: a window over a store folder
        comm = None
        win = fastcomms.store_window(rank, size, dev, path + ".d", "ring", timeout, landing)
    dwin = win.get_device_window(signal_count=2, counter_count=0, barrier_count=1)
    x = torch.empty(size * chunk, dtype=torch.float32, device=dev)
    x_buf = win.register_local_buffer(x)  # the source of put_block
    every = inputs(size, size * chunk)
    want = torch.stack(every).sum(0)
    for call in range(calls):
        x.copy_(every[rank].to(dev) * (call + 1))
        ring_all_reduce[(1,)](dwin, x_buf, x, chunk, call, BLOCK=BLOCK, num_warps=4)
        got = x.cpu()
        assert torch.equal(got, want * (call + 1)), f"rank {rank} call {call}: wrong sum"
    torch.cuda.synchronize()
    win.deregister_local_buffer(x_buf)
    win.tensor_deregister()
    if comm is not None:
        comm.finalize()
    if rank == 0:
        print(
            f"ring all-reduce of {size * chunk} floats on {size} ranks, {calls} calls: "
            "matches torch"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "store.d"))
        mp.start_processes(
            run,
            args=(a.nproc, os.path.join(d, "store"), a.numel, a.calls),
            nprocs=a.nproc,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
