# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms.moe dispatch and combine (issue 53) on its figure's shape: 4096 tokens x 4096
hidden bf16 per rank, top-8 of 64 experts, uniform routing (k distinct experts at random) and
skewed routing (experts drawn with weights ~ 1 / (e + 1)). Time per call of

- ``device dispatch`` / ``device combine``: a group over a fastcomms nvlink communicator (the
  device transport: NOTE [moe device transport], no host sync); ``device graph``: one dispatch +
  combine captured in a CUDA graph and replayed (launch cost gone);
- ``collective dispatch`` / ``collective combine``: a group over torch's NCCL default group (the
  collective transport: NCCL all-to-alls, one host sync per dispatch); needs one GPU per rank
  (NCCL refuses ranks sharing a GPU), else printed as skipped with the reason;
- ``device dispatch fp8``: the device dispatch with ``wire_dtype=torch.float8_e4m3fn`` (rows
  quantized before the move, dequantized after);
- ``device dispatch (torch plan)``: the device dispatch with its routing plan in torch ops (the
  baseline of NOTE [moe plan kernels]: the same rows, some 700 ops on the host);
- ``device dispatch (tail zeroed)`` / ``device dispatch fp8 (tail zeroed)``: the baseline of NOTE
  [moe recv_x tail]: recv_x's rows past the counts zeroed and FP8 rows dequantized over the whole
  buffer, as before 2026-12-07;
- ``device combine (rows packed)``: the baseline of NOTE [indexed push]: the combine packs
  ``y``'s rows into a send buffer before the exchange, as before 2026-12-07;
- ``local copy of the rows recv_x holds``: one device-local ``copy_`` of as many bytes as the
  dispatch writes into recv_x (its rows in use, one per (token, local expert)): the memory floor
  of the expert-grouped layout, which no dispatch can beat on this GPU's HBM (``recv_bytes``);
- ``host time per call``: the Python call's own time (GPU drained before each call), medians;
- ``flat peer copy (the bytes dispatch sends)``: the issue's yardstick. Each rank copies, with one
  ``copy_`` per peer into memory on the peer's GPU (the copy engine; both directions at once, as
  in the all-to-all), exactly the bytes its dispatch sends off the rank: one row of ``hidden``
  per (token, destination rank) pair. Combine brings the same bytes back, so the same copy is
  its yardstick too. Rows report the bytes (``bytes_sent``);
- ``symm_mem all_to_all_vdev_2d`` / ``symm_mem all_to_all_vdev_2d_offset``: torch's NVSHMEM
  all-to-alls on the same routing (the anchor): rows permuted by expert outside the timing, one
  row per (token, expert) pair as that op moves them; the received row count is checked against
  the device dispatch's. Runs where NVSHMEM is available and 2 or more ranks each have their own
  GPU (else a skipped row says why); ``--no-symm-mem`` leaves it out.

Before timing, the device transport's rows and combine are compared bit for bit with the
collective transport's where both run. Rounds interleave the variants; each round times
``--iters`` calls with CUDA events after a host barrier; medians of the rounds after one warm-up
round, the slowest rank's. Ranks are spawned on GPU rank % device_count; with ranks sharing one
GPU run it under tools/gpu/mps.sh (every figure is then an HBM copy, not a link figure). A
benchmark, not a test. Prints an ``env`` line, then one JSON line per (routing, variant).

Usage: python3 tools/gpu/bench_moe.py [--nproc 2] [--rounds 7] [--iters 10] [--tokens 4096]
       [--hidden 4096] [--experts 64] [--topk 8] [--profile] [--no-symm-mem]"""

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from _bench_common import host_per_call, print_env, print_slowest_rank, spawn_ranks


def _routing(kind, tokens, experts, k, gen):
    if kind == "uniform":
        return torch.rand(tokens, experts, generator=gen).argsort(1)[:, :k]
    w = 1.0 / (torch.arange(experts, dtype=torch.float64) + 1)
    return torch.multinomial(w.expand(tokens, experts), k, replacement=False, generator=gen)


def _rows_sent(idx, rank, size, experts):
    """Rows this rank's dispatch sends to each rank: one per (token, destination rank) pair (a
    token routed to several experts of one rank crosses once); the entry for ``rank`` is 0."""
    per = experts // size
    dst = torch.where(idx >= 0, idx // per, size)  # dropped (-1) -> a spare column
    sent = torch.zeros(idx.shape[0], size + 1, dtype=torch.bool, device=idx.device)
    sent.scatter_(1, dst, True)
    rows = sent[:, :size].sum(0).tolist()
    rows[rank] = 0
    return rows


def _flat_copy(rows, hidden, dtype, dev, ngpu):
    """One ``copy_`` per peer of that peer's bytes into memory on the peer's GPU."""
    pairs = [
        (
            torch.empty(n * hidden, dtype=dtype, device=dev),
            torch.empty(n * hidden, dtype=dtype, device=torch.device("cuda", p % ngpu)),
        )
        for p, n in enumerate(rows)
        if n
    ]

    def fn():
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)

    return fn


def _local_copy(nbytes, dev):
    """One device-local ``copy_`` of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def fn():
        dst.copy_(src, non_blocking=True)

    return fn


def _switched(g, name, value, fn):
    """fn() with the device transport's benchmark switch ``name`` set to ``value`` (a baseline:
    ``plan_kernels`` False, NOTE [moe plan kernels]; ``zero_tail`` True, NOTE [moe recv_x tail];
    ``pack_rows`` True, NOTE [indexed push]), then the switch back as it was."""
    old = getattr(g._transport, name)
    setattr(g._transport, name, value)
    try:
        return fn()
    finally:
        setattr(g._transport, name, old)


def _symm_mem_anchor(x, idx, experts, size, group_name):
    """torch's all_to_all_vdev_2d (dispatch) and all_to_all_vdev_2d_offset (its reverse) on this
    routing: (dispatch, combine, rows received)."""
    import torch.distributed._symmetric_memory as symm_mem

    T, k = idx.shape
    H, dev, dt = x.shape[1], x.device, x.dtype
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows by global expert id: rank-major
    kept = order[flat[order] >= 0]
    splits = torch.bincount(flat[flat >= 0], minlength=experts)
    inp = symm_mem.empty((T * k, H), dtype=dt, device=dev)
    inp[: kept.numel()].copy_(x[kept // k])
    out = symm_mem.empty((T * k * size, H), dtype=dt, device=dev)  # one rank may receive all
    back = symm_mem.empty((T * k, H), dtype=dt, device=dev)
    in_splits = symm_mem.empty(experts, dtype=torch.int64, device=dev)
    in_splits.copy_(splits)
    out_so = symm_mem.empty((2, experts), dtype=torch.int64, device=dev)
    back_so = symm_mem.empty((2, experts), dtype=torch.int64, device=dev)
    for t in (inp, out, back, in_splits, out_so, back_so):
        symm_mem.rendezvous(t, group_name)

    def disp():
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, group_name)

    def comb():
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, group_name)

    disp()
    torch.cuda.synchronize()
    return disp, comb, int(out_so[0].sum())


def _timed(fn, iters, barrier):
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters  # µs per call


def _host_cost(g, x, idx, w):
    """Host time of one eager call (the Python call returning), the GPU drained after each call
    (``iters=1``): a dispatch enqueues some 200 kernels, so back-to-back calls would time a full
    launch queue, not the host."""
    recv_x, _, handle = g.dispatch(x, idx, w)
    return {
        "device dispatch: host time per call": host_per_call(
            lambda: g.dispatch(x, idx, w), iters=1, rounds=50, warmup=3
        ),
        "device dispatch (torch plan): host time per call": host_per_call(
            lambda: _switched(g, "plan_kernels", False, lambda: g.dispatch(x, idx, w)),
            iters=1,
            rounds=50,
            warmup=3,
        ),
        "device combine: host time per call": host_per_call(
            lambda: g.combine(recv_x, handle), iters=1, rounds=50, warmup=3
        ),
    }


def _profile(rank, fn, barrier):
    """--profile: each rank's CUDA kernels of one device dispatch + combine, by total time (rank
    0 prints them)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    barrier()
    if rank == 0:
        table = prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=25, max_name_column_width=60
        )
        print(table, file=sys.stderr, flush=True)


def _rank(rank, world, path, args, outq):
    import fastcomms
    from fastcomms.moe import ExpertParallelGroup

    ngpu = torch.cuda.device_count()
    shared = ngpu < world  # ranks share GPUs: MPS clients, no NCCL
    torch.cuda.set_device(rank % ngpu)
    dev = torch.device("cuda", torch.cuda.current_device())
    store = dist.FileStore(path, world)
    backend = "gloo" if shared else "nccl"
    kw = {} if shared else {"device_id": dev}
    dist.init_process_group(
        backend, store=dist.PrefixStore("torch", store), rank=rank, world_size=world, **kw
    )
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world)
    comm = fastcomms.new_comm(
        "nvlink",
        dev,
        "bench_moe",
        store=dist.PrefixStore("fc", store),
        timeout=datetime.timedelta(seconds=120),
        hints={"nvlink.lazy_nccl": "1"} if shared else None,
    )
    ctrl = dist.new_group(backend="gloo") if not shared else None

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group=ctrl)

    T, H, E, k, dt = args.tokens, args.hidden, args.experts, args.topk, torch.bfloat16
    symm_why = None
    if args.no_symm_mem:
        symm_why = "--no-symm-mem"
    elif shared:
        symm_why = "ranks share a GPU: NVSHMEM wants a GPU per rank"
    elif world < 2:
        symm_why = "one rank: torch's symm_mem rendezvous needs 2 or more"
    else:
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            symm_why = "NVSHMEM is not available in this torch build or on this machine"
        else:
            # the anchor's buffers (inputs, worst-case outputs, the reverse's) pass NVSHMEM's
            # default symmetric heap at the figure's shape
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))
            symm_mem.set_backend("NVSHMEM")
    groups = {"device": ExpertParallelGroup(comm, E, H, max_tokens_per_rank=T, dtype=dt)}
    assert groups["device"].transport == "device", groups["device"].transport_reason
    skipped = {}
    if shared:
        why = "ranks share a GPU: NCCL refuses duplicate GPUs"
        skipped["collective dispatch"] = skipped["collective combine"] = why
    else:
        groups["collective"] = ExpertParallelGroup(None, E, H, max_tokens_per_rank=T, dtype=dt)
    if symm_why is not None:
        skipped["symm_mem all_to_all_vdev_2d"] = skipped["symm_mem all_to_all_vdev_2d_offset"] = (
            symm_why
        )
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for kind in ("uniform", "skewed"):
        x = torch.randn(T, H, generator=gen).to(dev, dt)
        idx = _routing(kind, T, E, k, gen).to(dev)
        w = torch.rand(T, k, generator=gen).to(dev)
        res, variants = {}, {}
        with torch.no_grad():
            for name, g in groups.items():
                recv_x, meta, handle = g.dispatch(x, idx, w)
                out = g.combine(recv_x, handle)
                res[name] = (recv_x, meta.offsets, out)

                def disp(g=g, x=x, idx=idx, w=w):
                    g.dispatch(x, idx, w)

                def comb(g=g, y=recv_x, h=handle):
                    g.combine(y, h)

                variants[f"{name} dispatch"], variants[f"{name} combine"] = disp, comb
                if name == "device":

                    def disp8(g=g, x=x, idx=idx, w=w):
                        g.dispatch(x, idx, w, wire_dtype=torch.float8_e4m3fn)

                    variants["device dispatch fp8 (e4m3, dequantized)"] = disp8

                    def disp_torch_plan(g=g, x=x, idx=idx, w=w):
                        _switched(g, "plan_kernels", False, lambda: g.dispatch(x, idx, w))

                    variants["device dispatch (torch plan)"] = disp_torch_plan

                    def disp_zeroed(g=g, x=x, idx=idx, w=w):
                        _switched(g, "zero_tail", True, lambda: g.dispatch(x, idx, w))

                    def disp8_zeroed(g=g, x=x, idx=idx, w=w):
                        _switched(
                            g,
                            "zero_tail",
                            True,
                            lambda: g.dispatch(x, idx, w, wire_dtype=torch.float8_e4m3fn),
                        )

                    def comb_packed(g=g, y=recv_x, h=handle):
                        _switched(g, "pack_rows", True, lambda: g.combine(y, h))

                    variants["device combine (rows packed)"] = comb_packed
                    variants["device dispatch (tail zeroed)"] = disp_zeroed
                    variants["device dispatch fp8 (tail zeroed)"] = disp8_zeroed
            if "collective" in res:  # the same bits on both transports
                a, b = res["device"], res["collective"]
                n = int(a[1][-1])
                assert torch.equal(a[1], b[1]), f"{kind}: offsets differ"
                assert torch.equal(a[0][:n].view(torch.int16), b[0][:n].view(torch.int16))
                assert torch.equal(a[2].view(torch.int16), b[2].view(torch.int16))
            g = groups["device"]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                recv_x, meta, handle = g.dispatch(x, idx, w)
                g.combine(recv_x, handle)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                recv_x, meta, handle = g.dispatch(x, idx, w)
                g.combine(recv_x, handle)
            variants["device graph (dispatch + combine)"] = graph.replay
            sent = _rows_sent(idx, rank, world, E)
            variants["flat peer copy (the bytes dispatch sends)"] = _flat_copy(
                sent, H, dt, dev, ngpu
            )
            recv_bytes = int(res["device"][1][-1]) * H * x.element_size()
            variants["local copy of the rows recv_x holds"] = _local_copy(recv_bytes, dev)
            if symm_why is None:
                sdisp, scomb, got_rows = _symm_mem_anchor(
                    x, idx, E, world, dist.group.WORLD.group_name
                )
                want_rows = int(res["device"][1][-1])
                assert got_rows == want_rows, f"{kind}: symm_mem {got_rows} rows, ours {want_rows}"
                variants["symm_mem all_to_all_vdev_2d"] = sdisp
                variants["symm_mem all_to_all_vdev_2d_offset"] = scomb
            if args.profile and kind == "uniform":
                _profile(rank, lambda: (disp(), comb()), barrier)
            host = _host_cost(groups["device"], x, idx, w)
            barrier()
            times = {n: [] for n in variants}
            for r in range(args.rounds + 1):
                for name, fn in variants.items():
                    t = _timed(fn, args.iters, barrier)
                    if r > 0:
                        times[name].append(t)
        for name, ts in times.items():
            rows.append(
                {"routing": kind, "variant": name, "rank": rank, "median_us": statistics.median(ts)}
            )
            if name.startswith("flat peer copy"):
                rows[-1]["bytes_sent"] = sum(sent) * H * x.element_size()
            if name.startswith("local copy"):
                rows[-1]["recv_bytes"] = recv_bytes
        for name, us in host.items():
            rows.append({"routing": kind, "variant": name, "rank": rank, "median_us": us})
        for name, why in skipped.items():
            rows.append({"routing": kind, "variant": name, "rank": rank, "skipped": why})
        barrier()
    groups["device"].check_errors()
    comm.finalize()
    outq.put(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="print rank 0's kernels of one call")
    ap.add_argument("--no-symm-mem", action="store_true", help="leave torch's symm_mem anchor out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    print_env(args.nproc)
    print("shape", json.dumps(vars(args)))
    got = spawn_ranks(_rank, args.nproc, args, timeout=900)
    print_slowest_rank(got, keep=("bytes_sent", "recv_bytes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
