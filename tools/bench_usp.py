# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""USP (Ulysses inside, a ring across) timings for one shape: a ring step (the K/V exchange of
ring attention), the Ulysses all-to-all of q, and a whole USP attention layer (forward, and
forward + backward) of examples/usp_attention.py. Medians of --iters runs after --warmup, the
slowest rank's; the environment is printed beside the numbers. A benchmark, not a test: nothing
is asserted (the example's own check, tests/python/test_ring.py, does that).

  # 2 nodes x 8 GPUs (Ulysses 8 inside each node, a ring of 2 across):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      tools/bench_usp.py --seq 131072 --heads 32 --kv-heads 8 --dim 128
  # CPU, gloo, tiny shapes:
  torchrun --nproc-per-node 4 tools/bench_usp.py --ring 2 --ulysses 2

--ulysses defaults to the ranks per node (LOCAL_WORLD_SIZE) and --ring to the rest. --comm picks
the groups: "fastcomms" (default: a fastcomms communicator, "nvlink" on one node, else "nccl",
split into the grid; CPU: gloo) or "torch" (torch.distributed's default group and DeviceMesh).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def _example():
    spec = importlib.util.spec_from_file_location(
        "usp_attention", os.path.join(ROOT, "examples", "usp_attention.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timer(device):
    """fn -> seconds of one call, synchronised (CUDA events on the current stream; CPU clock)."""
    if device.type == "cuda":

        def run(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3

    else:

        def run(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

    return run


def _median(fn, device, warmup, iters, barrier):
    run = _timer(device)
    for _ in range(warmup):
        run(fn)
    times = []
    for _ in range(iters):
        barrier()
        times.append(run(fn))
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
    return med.item()


def _environment(args, sp, device, dtype):
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    lines = [
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}",
        f"world {dist.get_world_size()} on {len(set(hosts))} host(s): ring {sp.ring_size} x "
        f"ulysses {sp.ulysses_size}; ring transport {sp.ring.transport} "
        f"({sp.ring.transport_reason}); all-to-all {sp.ulysses.transport}",
        f"groups: {args.comm}; device {device}; dtype {dtype}",
    ]
    if device.type == "cuda":
        lines.append(
            f"GPU {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
    else:
        lines.append(f"CPU threads {torch.get_num_threads()}")
    for k in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "FASTCOMMS_ENGINE"):
        if os.environ.get(k):
            lines.append(f"{k}={os.environ[k]}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ring", type=int, default=None)
    ap.add_argument("--ulysses", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="whole sequence (CPU default 64 x world)")
    ap.add_argument("--heads", type=int, default=None, help="default 32 (CPU: 2 x ulysses)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default heads / 4 (GQA)")
    ap.add_argument("--dim", type=int, default=None, help="default 128 (CPU: 16)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (CPU: float32)")
    ap.add_argument("--causal", action="store_true", help="zig-zag causal attention")
    ap.add_argument("--comm", choices=["fastcomms", "torch"], default="fastcomms")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)

    import fastcomms
    from fastcomms.sequence_parallel import SequenceParallelGroup

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    u = args.ulysses or (args.ring and world // args.ring) or per_node
    r = args.ring or world // u
    if cuda:
        heads, dim, dtype = args.heads or 32, args.dim or 128, args.dtype or "bfloat16"
        seq = args.seq or 8192 * world
    else:
        heads, dim, dtype = args.heads or 2 * u, args.dim or 16, args.dtype or "float32"
        seq = args.seq or 64 * world
    kv_heads = args.kv_heads or max(1, heads // 4)
    dtype = getattr(torch, dtype)
    if args.comm == "fastcomms":
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        backend = ("nvlink" if len(set(hosts)) == 1 else "nccl") if cuda else "gloo"
        comm = fastcomms.new_comm(backend, device, "bench_usp")
        sp = SequenceParallelGroup((r, u), group=comm)
    else:
        comm = None
        sp = SequenceParallelGroup((r, u))
    ex = _example()
    kv_replicas = sp.check_heads(heads, kv_heads)
    log = print if dist.get_rank() == 0 else (lambda *a: None)
    for line in _environment(args, sp, device, dtype):
        log(line)
    b, s_local = args.batch, seq // (r * u)
    s_ring = seq // r
    log(
        f"shape: b={b}, s={seq} (ring shard {s_ring}, per rank {s_local}), heads {heads} / "
        f"{kv_heads} K/V, d={dim}, {'causal (zig-zag)' if args.causal else 'non-causal'}; "
        f"kv_replicas {kv_replicas}; medians of {args.iters} after {args.warmup} warm-up, "
        "slowest rank"
    )
    gen = torch.Generator().manual_seed(dist.get_rank())

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rnd(b, s_local, heads, dim)
    k, v = rnd(b, s_local, kv_heads, dim), rnd(b, s_local, kv_heads, dim)
    barrier = dist.barrier
    rows = []

    # 1. a ring step: the K/V block of one ring rank after the all-to-all, to the next rank
    kv_heads_local = kv_heads * kv_replicas // u
    blk = [rnd(b, kv_heads_local, s_ring, dim), rnd(b, kv_heads_local, s_ring, dim)]
    ring_bytes = sum(t.numel() * t.element_size() for t in blk)
    if sp.ring_size > 1:
        t = _median(lambda: sp.ring.exchange(blk).wait(), device, args.warmup, args.iters, barrier)
        rows.append(("ring step (K+V block)", ring_bytes, t))
    # 2. the Ulysses all-to-all of q (mode 0), and of K with its replicas
    a2a_bytes = q.numel() * q.element_size()
    t = _median(lambda: sp.ulysses.all_to_all_4d(q), device, args.warmup, args.iters, barrier)
    rows.append(("ulysses all-to-all q", a2a_bytes, t))
    # 3. the whole USP attention layer
    t_fwd = _median(
        lambda: ex.usp_attention(q, k, v, sp, causal=args.causal),
        device,
        args.warmup,
        args.iters,
        barrier,
    )
    rows.append(("usp attention forward", None, t_fwd))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd_bwd():
        ex.usp_attention(qg, kg, vg, sp, causal=args.causal).sum().backward()

    rows.append(("usp attention fwd+bwd", None, _median(fwd_bwd, device, 1, args.iters, barrier)))
    log(f"{'what':28} {'MiB/rank':>9} {'ms':>10} {'GB/s (bytes/time)':>18}")
    for what, nbytes, t in rows:
        mib = f"{nbytes / 2**20:9.2f}" if nbytes else f"{'':9}"
        bw = f"{nbytes / t / 1e9:18.2f}" if nbytes else ""
        log(f"{what:28} {mib} {t * 1e3:10.3f} {bw}")
    sp.destroy()
    if comm is not None:
        comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
