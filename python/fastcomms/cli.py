# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The fastcomms command line: ``fastcomms bench`` and ``fastcomms doctor`` (API.md §3).

``python -m fastcomms bench --nproc 2`` spawns local CPU ranks over gloo, times the Ulysses
all-to-all against permute + torch.distributed.all_to_all_single + permute, checks every result
bit for bit, and prints a table. GPU runs go through scripts/gpu.sh for now (the CUDA transports
are not reachable from Python yet)."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import torch

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
}


def _nvlink(devices):
    from . import _C

    matrix, why = _C.nvlink_matrix(devices)
    return matrix, why


def doctor(_args) -> int:
    import fastcomms

    print(f"python      {sys.version.split()[0]}")
    print(f"torch       {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"fastcomms   {fastcomms.__file__}")
    print(f"backends    {', '.join(fastcomms.built_backends())}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs        {n}")
    for i in range(n):
        print(f"  cuda:{i}    {torch.cuda.get_device_name(i)}")
    if n >= 2:
        matrix, why = _nvlink(list(range(n)))
        if matrix is None:
            print(f"NVLink      unknown ({why})")
        else:
            for (a, b), v in sorted(matrix.items()):
                if a < b:
                    print(f"  {a}-{b}       {'NVLink' if v else 'no NVLink'}")
    from . import _C

    if n == 0 or not _C.has_transport("nvlink"):
        why = "no CUDA device" if n == 0 else "this build has no CUDA layer"
        print(f"transport   CPU tensors: the collective path over gloo ({why})")
    elif n == 1:
        print("transport   auto -> nvlink for CUDA tensors (ranks sharing GPU 0 of one host)")
    else:
        matrix, why = _nvlink(list(range(n)))
        joined = matrix is not None and all(v for (a, b), v in matrix.items() if a != b)
        print(
            "transport   auto -> "
            + (
                "nvlink for CUDA tensors (one host, every GPU pair NVLink-joined)"
                if joined
                else "collective for CUDA tensors ("
                + ("NVML cannot answer" if matrix is None else "a GPU pair lacks NVLink")
                + ")"
            )
        )
    return 0


def _progress(rank, text):
    """The live progress line on rank 0's terminal; None clears it."""
    if rank == 0 and sys.stderr.isatty():
        line = "\r" + " " * 70 + "\r" if text is None else f"\r  {text}"
        print(line, end="", file=sys.stderr, flush=True)


def _bench_rank(rank, size, path, args, q):
    import torch.distributed as dist

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    store = dist.FileStore(path, size)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=size
    )
    comm = fastcomms.new_comm(
        "gloo",
        "cpu",
        store=dist.PrefixStore("fc", store),
        name="bench",
        timeout=datetime.timedelta(seconds=120),
    )
    ours, ref = UlyssesGroup(comm), UlyssesGroup(None)
    dtype = DTYPES[args.dtype]
    rows = []
    for i, shape in enumerate(args.shapes):
        g = torch.Generator().manual_seed(rank * 1000 + i)
        x = torch.randint(0, 100, shape, generator=g).to(dtype)
        ok = torch.equal(ours.all_to_all_4d(x), ref.all_to_all_4d(x))
        ok = ok and torch.equal(ours.all_to_all_4d(ours.all_to_all_4d(x), mode=1), x)
        times = {"ours": [], "base": []}
        for it in range(args.warmup + args.iters):
            _progress(rank, f"[{i + 1}/{len(args.shapes)}] {tuple(shape)} iteration {it + 1}")
            for name, grp in (("ours", ours), ("base", ref)):
                dist.barrier()
                t0 = time.perf_counter()
                grp.all_to_all_4d(x)
                if it >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        rows.append(
            (
                tuple(shape),
                x.numel() * x.element_size(),
                statistics.median(times["ours"]),
                statistics.median(times["base"]),
                ok,
            )
        )
    _progress(rank, None)
    q.put((rank, rows, "collective over gloo"))
    comm.finalize()
    dist.destroy_process_group()


def _bench_gpu_rank(rank, size, path, args, q):
    """One rank of the GPU bench: ours (nvlink or the nccl collective path) against permute +
    torch.distributed NCCL all_to_all_single + permute, CUDA events, median after warm-up."""
    import torch.distributed as dist

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = dist.FileStore(path, size)
    dist.init_process_group(
        "nccl", store=dist.PrefixStore("torch", store), rank=rank, world_size=size, device_id=dev
    )
    comm = None
    if args.backend == "nccl":
        comm = fastcomms.new_comm(
            "nccl",
            dev,
            store=dist.PrefixStore("fc", store),
            name="bench",
            timeout=datetime.timedelta(seconds=120),
        )
        ours = UlyssesGroup(comm, transport="collective")
    else:
        ours = UlyssesGroup(
            None, device=dev, transport="nvlink" if args.backend == "nvlink" else "auto"
        )
    ref = UlyssesGroup(None, device=dev, transport="collective")
    dtype = DTYPES[args.dtype]
    rows = []
    for i, shape in enumerate(args.shapes):
        g = torch.Generator().manual_seed(rank * 1000 + i)
        raw = torch.randint(
            0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g
        )
        x = raw.view(dtype).view(shape).to(dev)
        out = ours.empty_output(x)
        ok = torch.equal(
            ours.all_to_all_4d(x).view(torch.uint8), ref.all_to_all_4d(x).view(torch.uint8)
        )
        ok = ok and torch.equal(
            ours.all_to_all_4d(ours.all_to_all_4d(x), mode=1).view(torch.uint8), x.view(torch.uint8)
        )
        times = {}
        for name, fn in (
            ("ours", lambda x=x, out=out: ours.all_to_all_4d(x, out=out)),
            ("base", lambda x=x: ref.all_to_all_4d(x)),
        ):
            ev = [
                torch.cuda.Event(enable_timing=True) for _ in range(2 * (args.warmup + args.iters))
            ]
            for it in range(args.warmup + args.iters):
                _progress(rank, f"[{i + 1}/{len(args.shapes)}] {tuple(shape)} {name} {it + 1}")
                ev[2 * it].record()
                fn()
                ev[2 * it + 1].record()
            torch.cuda.synchronize()
            times[name] = statistics.median(
                ev[2 * it].elapsed_time(ev[2 * it + 1]) / 1e3
                for it in range(args.warmup, args.warmup + args.iters)
            )
        rows.append((tuple(shape), x.numel() * x.element_size(), times["ours"], times["base"], ok))
    _progress(rank, None)
    stats = ours.memory_stats()
    q.put(
        (
            rank,
            rows,
            f"{ours.transport} ({ours.transport_reason}); "
            f"group holds {stats['device_bytes'] / 2**20:.1f} MiB",
        )
    )
    ours.destroy()
    if comm is not None:
        comm.finalize()
    dist.destroy_process_group()


def bench(args) -> int:
    import torch.multiprocessing as mp

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = args.backend in ("nccl", "nvlink") or (args.backend == "auto" and ngpu >= args.nproc >= 2)
    if gpu and ngpu < args.nproc:
        print(
            f"fastcomms bench: --backend {args.backend} with --nproc {args.nproc} needs "
            f"{args.nproc} GPUs (the permute baseline runs on torch.distributed NCCL, one GPU per "
            f"rank); this machine has {ngpu}",
            file=sys.stderr,
        )
        return 2
    size = args.nproc
    if args.shape:
        shape = [int(v) for v in args.shape.split(",")]
        if len(shape) != 4:
            print("fastcomms bench: --shape needs b,s,h,d", file=sys.stderr)
            return 2
        args.shapes = [shape]
    else:
        heads = 8 * size
        args.shapes = [[1, s, heads, 128] for s in (16, 64, 256, 1024)]
    for shape in args.shapes:
        if shape[2] % size:
            print(
                f"fastcomms bench: h={shape[2]} is not divisible by --nproc {size}", file=sys.stderr
            )
            return 2
    where = f"{size} GPUs, CUDA events" if gpu else "gloo, CPU ranks (processes)"
    print(
        f"fastcomms bench: {where}, {args.dtype}, {args.iters} iterations after {args.warmup} "
        "warm-up, median of the slowest rank"
    )
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(
                target=_bench_gpu_rank if gpu else _bench_rank,
                args=(r, size, os.path.join(d, "s"), args, q),
            )
            for r in range(size)
        ]
        for p in procs:
            p.start()
        results = []
        # never wait on a rank that died: a failed rank puts nothing in the queue
        while len(results) < len(procs):
            if not q.empty():
                results.append(q.get())
            elif any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                break
            else:
                time.sleep(0.05)
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        print("fastcomms bench: a rank failed", file=sys.stderr)
        return 1
    per_rank = [res[1] for res in sorted(results, key=lambda r: r[0])]
    if gpu:
        print(f"transport: {sorted(results, key=lambda r: r[0])[0][2]}")
    print(
        f"{'shape (b,s,h,d)':24s} {'MiB/rank':>9s} {'ours ms':>9s} {'GB/s':>7s} "
        f"{'permute ms':>11s} {'speed-up':>9s} {'check':>6s}"
    )
    bad = 0
    plot = []
    for i, (shape, nbytes, _, _, _) in enumerate(per_rank[0]):
        ours = max(r[i][2] for r in per_rank)
        base = max(r[i][3] for r in per_rank)
        ok = all(r[i][4] for r in per_rank)
        bad += not ok
        plot.append((nbytes, ours, base))
        print(
            f"{str(shape):24s} {nbytes / 2**20:9.2f} {ours * 1e3:9.3f} "
            f"{nbytes / ours / 1e9:7.2f} {base * 1e3:11.3f} {base / ours:8.2f}x "
            f"{'OK' if ok else 'FAIL':>6s}"
        )
    print("all checks passed" if not bad else "SOME CHECKS FAILED")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("fastcomms bench: --plot needs matplotlib", file=sys.stderr)
            return 2
        xs = [p[0] / 2**20 for p in plot]
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].loglog(xs, [p[1] * 1e3 for p in plot], "o-", label="fastcomms")
        ax[0].loglog(xs, [p[2] * 1e3 for p in plot], "s--", label="permute + all_to_all_single")
        ax[0].set(xlabel="MiB per rank", ylabel="ms", title="time")
        ax[1].semilogx(xs, [p[0] / p[1] / 1e9 for p in plot], "o-", label="fastcomms")
        ax[1].semilogx(xs, [p[0] / p[2] / 1e9 for p in plot], "s--", label="permute path")
        ax[1].set(xlabel="MiB per rank", ylabel="GB/s", title="throughput")
        for a in ax:
            a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot written to {args.plot}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fastcomms")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time and check the Ulysses all-to-all")
    b.add_argument("--backend", default="auto", choices=["gloo", "nccl", "nvlink", "auto"])
    b.add_argument("--nproc", type=int, default=2)
    b.add_argument("--shape", default=None, help="b,s,h,d (mode 0's input on each rank)")
    b.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--plot", default=None, help="write a PNG of the sweep")
    sub.add_parser("doctor", help="versions, GPUs, NVLink matrix, backends")
    args = ap.parse_args(argv)
    return bench(args) if args.cmd == "bench" else doctor(args)


if __name__ == "__main__":
    sys.exit(main())
