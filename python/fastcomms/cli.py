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


def _check_rank(rank, size, path, backend, q):
    """One rank of `fastcomms check`: every op on `backend` against values each rank can compute
    for every rank, results as (name, ok, detail)."""
    import torch.distributed as dist

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    dev = torch.device("cuda", rank) if backend in ("nccl", "nvlink") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    results = []
    comm = None

    def run(name, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
            ok, detail = False, f"{type(e).__name__}: {e}"[:300]
        results.append((name, bool(ok), detail))

    def full(n, v, dtype=torch.float32):
        return torch.full((n,), float(v), dtype=dtype, device=dev)

    try:
        comm = fastcomms.new_comm(
            backend,
            dev,
            "check",
            store=dist.FileStore(path, size),
            timeout=datetime.timedelta(seconds=60),
        )
        n, k, S = size, 4, fastcomms.ReduceOp.SUM

        def all_reduce():
            t = full(k, rank + 1)
            comm.all_reduce(t, S, False)
            return torch.equal(t, full(k, n * (n + 1) // 2)), ""

        def all_reduce_max():
            t = full(k, rank)
            comm.all_reduce(t, fastcomms.ReduceOp.MAX, False)
            return torch.equal(t, full(k, n - 1)), ""

        def broadcast():
            t = full(k, rank)
            comm.broadcast(t, n - 1, False)
            return torch.equal(t, full(k, n - 1)), ""

        def reduce():
            t = full(k, rank + 1)
            comm.reduce(t, 0, S, False)
            return rank != 0 or torch.equal(t, full(k, n * (n + 1) // 2)), ""

        def all_gather_single():
            out = full(n * k, -1)
            comm.all_gather_single(out, full(k, rank), False)
            want = torch.arange(n, device=dev).repeat_interleave(k).float()
            return torch.equal(out, want), ""

        def reduce_scatter_single():
            out = full(k, -1)
            comm.reduce_scatter_single(out, full(n * k, rank + 1), S, False)
            return torch.equal(out, full(k, n * (n + 1) // 2)), ""

        def all_to_all_single():
            inp = (rank * n + torch.arange(n, device=dev)).repeat_interleave(k).float()
            out = full(n * k, -1)
            comm.all_to_all_single(out, inp, False)
            want = (torch.arange(n, device=dev) * n + rank).repeat_interleave(k).float()
            return torch.equal(out, want), ""

        def barrier():
            comm.barrier(False)
            return True, ""

        def send_recv():
            got = full(k, -1)
            b = comm.batch_op_create()
            b.send(full(k, rank), (rank + 1) % n)
            b.recv(got, (rank - 1) % n)
            b.issue(False)
            return torch.equal(got, full(k, (rank - 1) % n)), ""

        def ulysses():
            g = UlyssesGroup(comm, device=dev)
            xs = [
                torch.randn(2, 3, 2 * n, 8, generator=torch.Generator().manual_seed(q)).to(dev)
                for q in range(n)
            ]
            y = g.all_to_all_4d(xs[rank])
            want = torch.cat([x[:, :, 2 * rank : 2 * rank + 2] for x in xs], dim=1)
            back = g.all_to_all_4d(y, mode=1)
            ok = torch.equal(y, want) and torch.equal(back, xs[rank])
            return ok, f"transport {g.transport}"

        for name, fn in [
            ("all_reduce (sum)", all_reduce),
            ("all_reduce (max)", all_reduce_max),
            ("broadcast", broadcast),
            ("reduce", reduce),
            ("all_gather_single", all_gather_single),
            ("reduce_scatter_single", reduce_scatter_single),
            ("all_to_all_single", all_to_all_single),
            ("barrier", barrier),
            ("send/recv ring", send_recv),
            ("ulysses all_to_all_4d", ulysses),
        ]:
            run(name, fn)
    except Exception as e:  # noqa: BLE001
        results.append(("new_comm", False, f"{type(e).__name__}: {e}"[:300]))
    q.put((rank, results))
    if comm is not None:
        comm.finalize()


def check(args) -> int:
    """A short correctness run of every op on one backend, results per op and rank."""
    import json

    import torch.multiprocessing as mp

    backend = args.backend
    if backend == "auto":
        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if ngpu >= args.nproc else "gloo"
        why = f"{ngpu} GPUs for {args.nproc} ranks"
    else:
        why = "asked"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_check_rank, args=(r, args.nproc, os.path.join(d, "s"), backend, q))
            for r in range(args.nproc)
        ]
        for p in procs:
            p.start()
        res = {}
        deadline = time.monotonic() + 300
        while len(res) < args.nproc and time.monotonic() < deadline:
            try:
                r, rows = q.get(timeout=1.0)
                res[r] = rows
            except Exception:  # noqa: BLE001 - queue.Empty: look for dead ranks
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and len(res) + len(dead) >= args.nproc:
                    break
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    print(f"fastcomms check: backend {backend} ({why}), {args.nproc} ranks")
    names = [name for name, _, _ in res.get(0, [])] or ["new_comm"]
    bad = 0
    table = []
    for i, name in enumerate(names):
        per_rank = [
            res[r][i] if r in res and i < len(res[r]) else (name, False, "no result")
            for r in range(args.nproc)
        ]
        ok = all(x[1] for x in per_rank)
        bad += not ok
        detail = next((x[2] for x in per_rank if not x[1]), per_rank[0][2])
        table.append({"op": name, "ok": ok, "detail": detail})
        print(f"  {name:24s} {'OK' if ok else 'FAIL'}  {detail}")
    print("all checks passed" if not bad and res else f"{bad} checks failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "nproc": args.nproc, "results": table}, f, indent=1)
    return 0 if not bad and len(res) == args.nproc else 1


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
    c = sub.add_parser("check", help="a short correctness run of every op on one backend")
    c.add_argument("--backend", default="auto", choices=["gloo", "nccl", "nvlink", "auto"])
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    return {"bench": bench, "check": check, "doctor": doctor}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
