# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One rank of the launcher tier (tests/python/test_launch.py), started the way users start
ranks: by torchrun, or as a plain process with SLURM's, Open MPI's or RANK/WORLD_SIZE's variables
set. It makes its communicators with no store, as a user's script does (NOTE [launchers]), and
checks every result against torch.distributed on the same inputs (random data, a fresh seed each
run). Prints ``LAUNCH OK <launch description>`` at the end; any failure raises.

  --order fastcomms-first | torch-first | no-torch   when torch.distributed's default group is made
  --full      every collective once, split, a second communicator, the Ulysses op, a DeviceMesh
  --device    cpu (gloo) or cuda (nccl / nvlink: a world that fits the GPUs, or ranks sharing one)
"""

from __future__ import annotations

import argparse
import datetime
import sys

import fastcomms
import torch
import torch.distributed as dist
from fastcomms import ReduceOp


def _torch_group(device):
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _same(got, want, what):
    if not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
        raise AssertionError(f"{what}: got {got.flatten()[:8].tolist()}, want {want[:8].tolist()}")


def _ring(c, x, rank, size):
    got = torch.full_like(x, -1.0)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if rank % 2 == 0:
        c.send(x, nxt, False)
        c.recv(got, prv, False)
    else:
        c.recv(got, prv, False)
        c.send(x, nxt, False)
    want = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, want, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    _same(got, want, "send/recv ring")


def _full(c, device, rank, size, gen):
    """Every collective once against torch.distributed's default group (same ranks)."""
    n = 5 + int(torch.randint(0, 60, (1,), generator=gen))
    x = torch.randn(size, n, generator=gen)[rank].to(device)  # differs per rank

    def run(name, ours, theirs, make):
        a, b = make(), make()
        ours(a)
        theirs(b)
        _same(a, b, name)

    run("all_reduce SUM", lambda t: c.all_reduce(t, ReduceOp.SUM, False),
        lambda t: dist.all_reduce(t), lambda: x.clone())  # fmt: skip
    run("all_reduce MAX", lambda t: c.all_reduce(t, ReduceOp.MAX, False),
        lambda t: dist.all_reduce(t, dist.ReduceOp.MAX), lambda: x.clone())  # fmt: skip
    run("broadcast", lambda t: c.broadcast(t, size - 1, False),
        lambda t: dist.broadcast(t, size - 1), lambda: x.clone())  # fmt: skip
    a, b = x.clone(), x.clone()
    c.reduce(a, 0, ReduceOp.SUM, False)
    dist.reduce(b, 0)
    if rank == 0:
        _same(a, b, "reduce")
    a, b = torch.full((size * n,), -1.0, device=device), torch.empty(size * n, device=device)
    c.all_gather_single(a, x, False)
    dist.all_gather_into_tensor(b, x)
    _same(a, b, "all_gather_single")
    la = [torch.full_like(x, -1.0) for _ in range(size)]
    c.all_gather(la, x, False)
    _same(torch.stack(la), b.view(size, n), "all_gather")
    big = torch.randn(size * size * n, generator=gen).to(device) * (rank + 1)
    a, b = torch.full((size * n,), -1.0, device=device), torch.empty(size * n, device=device)
    c.reduce_scatter_single(a, big, ReduceOp.SUM, False)
    dist.reduce_scatter_tensor(b, big)
    _same(a, b, "reduce_scatter_single")
    a, b = torch.full_like(big, -1.0), torch.empty_like(big)
    c.all_to_all_single(a, big, False)
    dist.all_to_all_single(b, big)
    _same(a, b, "all_to_all_single")
    # gather / scatter at the last rank
    root = size - 1
    la = [torch.full_like(x, -1.0) for _ in range(size)] if rank == root else []
    c.gather(la, x, root, False)
    lb = [torch.empty_like(x) for _ in range(size)] if rank == root else None
    dist.gather(x, lb, dst=root)
    if rank == root:
        _same(torch.stack(la), torch.stack(lb), "gather")
    parts = [x * (i + 1) for i in range(size)]
    a, b = torch.full_like(x, -1.0), torch.empty_like(x)
    c.scatter(a, parts if rank == root else [], root, False)
    dist.scatter(b, parts if rank == root else None, src=root)
    _same(a, b, "scatter")
    # a ring of send/recv (a world of one has no peer)
    if size > 1:
        _ring(c, x, rank, size)
    c.barrier(False)
    # split: the even ranks and the odd ranks, each its own all_reduce
    members = [r for r in range(size) if r % 2 == rank % 2]
    sub = c.split(members, f"parity{rank % 2}")
    t = torch.full((4,), float(rank + 1), device=device)
    sub.all_reduce(t, ReduceOp.SUM, False)
    _same(t, torch.full((4,), float(sum(r + 1 for r in members)), device=device), "split")
    sub.finalize()
    # the Ulysses op against permute + all_to_all_single + permute
    from fastcomms._bench import permute_all_to_all_4d
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(c)
    shape = (2, 3 + int(torch.randint(0, 5, (1,), generator=gen)), 2 * size, 8)
    q = torch.randn(size, *shape, generator=gen)[rank].to(device)
    out = g.all_to_all_4d(q)
    _same(out, permute_all_to_all_4d(q, 0, size), "ulysses all_to_all_4d")
    _same(g.all_to_all_4d(out, mode=1), q, "ulysses round trip")
    # a DeviceMesh over this communicator (the default group stays torch's)
    from fastcomms.device_mesh import init_device_mesh

    mesh = init_device_mesh((c,), ("dp",))
    t = x.clone()
    dist.all_reduce(t, group=mesh.get_group("dp"))
    ref = x.clone()
    dist.all_reduce(ref)
    _same(t, ref, "DeviceMesh all_reduce")


def _shared_gpu_ulysses(launch, device):
    """Ranks sharing one GPU (NCCL refuses them): torch's gloo default group, the Ulysses op on
    the nvlink transport, checked against permute + all_to_all_single on CPU over gloo."""
    from fastcomms._bench import permute_all_to_all_4d
    from fastcomms.ulysses import UlyssesGroup

    dist.init_process_group("gloo")
    size = launch.size
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(seed, 0)  # a fresh seed every run, the same on every rank
    gen = torch.Generator().manual_seed(int(seed.item()))
    g = UlyssesGroup(None, device=device, transport="nvlink")
    for dtype in (torch.bfloat16, torch.float32):
        shape = (1, 4 + int(torch.randint(0, 28, (1,), generator=gen)), 2 * size, 64)
        x = torch.randn(size, *shape, generator=gen)[launch.rank].to(dtype)
        want = permute_all_to_all_4d(x, 0, size)
        out = g.empty_output(x.to(device))
        out.view(torch.uint8).fill_(0xA5)  # poisoned: an unwritten byte shows
        g.all_to_all_4d(x.to(device), out=out)
        _same(out.cpu(), want, f"shared-GPU ulysses {dtype}")
        _same(g.all_to_all_4d(out, mode=1).cpu(), x, f"shared-GPU ulysses round trip {dtype}")
    g.destroy()
    dist.destroy_process_group()
    print(f"LAUNCH OK {launch.describe()} (ulysses over nvlink, GPU shared)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="fastcomms-first",
                    choices=["fastcomms-first", "torch-first", "no-torch"])  # fmt: skip
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--shared-gpu-ulysses", action="store_true")
    args = ap.parse_args()
    from fastcomms import _bootstrap

    launch = _bootstrap.required("launch_worker")
    device = torch.device("cpu")
    if args.device == "cuda":
        local = launch.local_rank if launch.local_rank is not None else launch.rank
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if args.shared_gpu_ulysses:
        return _shared_gpu_ulysses(launch, device)
    backend = args.backend or ("gloo" if device.type == "cpu" else "nccl")
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.order == "torch-first":
        _torch_group(device)
    c = fastcomms.new_comm(backend, device, name="w", timeout=timeout)
    if args.order == "fastcomms-first":
        _torch_group(device)
    rank, size = c.get_rank(), c.get_size()
    assert (rank, size) == (launch.rank, launch.size), ((rank, size), launch)
    t = torch.ones(4, device=device) * (rank + 1)
    c.all_reduce(t, ReduceOp.SUM, False)
    _same(t, torch.full((4,), float(size * (size + 1) // 2), device=device), "all_reduce")
    # a second communicator in the same job: its own key space on the same store
    c2 = fastcomms.new_comm(backend, device, name="w2", timeout=timeout)
    seed = (
        torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
        if rank == 0
        else (torch.zeros(1, dtype=torch.int64, device=device))
    )
    c2.broadcast(seed, 0, False)  # a fresh seed every run, the same on every rank
    if args.full:
        _full(c, device, rank, size, torch.Generator().manual_seed(int(seed.item())))
    c2.finalize()
    c.barrier(False)
    c.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"LAUNCH OK {launch.describe()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
