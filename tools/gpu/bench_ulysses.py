# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Python-level Ulysses benchmark on 2+ GPUs (one rank per GPU), run by scripts/gpu.sh under
tools/gpu/exclusive.py. Modes (each against permute + torch.distributed NCCL all_to_all_single +
permute in the same run, CUDA events, median after warm-up, every result checked bit for bit):

  padding  uneven shards vs the same data padded to even shards (ours and the permute path)
  overlap  the share of an async all-to-all hidden under a chain of bf16 GEMMs on the caller's
           stream: (T_gemm + T_a2a - T_both) / T_a2a, for the SM engine and the zero-SM
           (copy-engine) engine
and prints the group's memory_stats(). Usage: python3 tools/gpu/bench_ulysses.py [--nproc N]
"""

import argparse
import os
import queue
import statistics
import sys
import tempfile

import torch
import torch.multiprocessing as mp

WARMUP, ITERS = 5, 20


def _timed(fn, iters=ITERS, warmup=WARMUP):
    for _ in range(warmup):
        fn()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)  # µs


def _rank(rank, size, path, q):
    import torch.distributed as dist
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = dist.FileStore(path, size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=dev)
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    ref = UlyssesGroup(None, device=dev, transport="collective")
    out = []
    gen = torch.Generator(device=dev).manual_seed(rank)

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    # -- padding: uneven shards vs padded to the largest shard ---------------------------------
    heads, d, total = 40, 128, 75600
    base = total // size
    seq = [base + (size - 1 - 2 * p) * 600 for p in range(size)]  # uneven, same total
    seq[-1] += total - sum(seq)
    hs = [heads // size] * size
    x = torch.randn(1, seq[rank], heads, d, generator=gen, device=dev, dtype=torch.bfloat16)
    pad = max(seq)
    xp = torch.zeros(1, pad, heads, d, device=dev, dtype=torch.bfloat16)
    xp[:, : seq[rank]] = x
    ok = same(
        g.all_to_all_4d(x, seq_splits=seq, head_splits=hs),
        ref.all_to_all_4d(x, seq_splits=seq, head_splits=hs),
    )
    zo = g.empty_output(x, seq_splits=seq, head_splits=hs)
    zp = g.empty_output(xp)
    t = {
        "ours uneven (zero copy)": _timed(
            lambda: g.all_to_all_4d(x, out=zo, seq_splits=seq, head_splits=hs)
        ),
        "ours padded (zero copy)": _timed(lambda: g.all_to_all_4d(xp, out=zp)),
        "permute uneven": _timed(lambda: ref.all_to_all_4d(x, seq_splits=seq, head_splits=hs)),
        "permute padded": _timed(lambda: ref.all_to_all_4d(xp)),
    }
    out.append(("padding", f"seq splits {seq}, 40 heads, d=128, bf16", t, ok))

    # -- overlap: async all-to-all under a GEMM chain -------------------------------------------
    n = 8192
    a_m = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=gen)
    chain = 6
    xo = torch.randn(1, 37800 // size, heads, d, generator=gen, device=dev, dtype=torch.bfloat16)

    def gemms():
        y = a_m
        for _ in range(chain):
            y = y @ a_m
        return y

    for engine in ("sm", "ce"):
        g._tune("engine", engine)  # FASTCOMMS_ENGINE is read once per process
        want = ref.all_to_all_4d(xo)
        ok = same(g.all_to_all_4d_async(xo).wait(), want)
        t_gemm = _timed(gemms, iters=10, warmup=3)
        t_a2a = _timed(lambda: g.all_to_all_4d_async(xo).wait(), iters=10, warmup=3)

        def both():
            w = g.all_to_all_4d_async(xo)
            gemms()
            w.wait()

        t_both = _timed(both, iters=10, warmup=3)
        hidden = (t_gemm + t_a2a - t_both) / t_a2a if t_a2a > 0 else 0.0
        label = "zero-SM (copy engines)" if engine == "ce" else "SM engine"
        t = {"gemm chain": t_gemm, "a2a alone": t_a2a, "both": t_both, "hidden %": 100 * hidden}
        out.append(("overlap", f"{label}, (1,37800,40,128) bf16 vs {chain} GEMMs {n}^3", t, ok))
    g._tune("engine", "auto")
    stats = g.memory_stats()
    q.put((rank, out, stats, f"{g.transport} ({g.transport_reason})"))
    g.destroy()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    if torch.cuda.device_count() < args.nproc:
        print(f"SKIPPED: bench_ulysses needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_rank, args=(r, args.nproc, os.path.join(d, "s"), q))
            for r in range(args.nproc)
        ]
        for p in procs:
            p.start()
        res = []
        while len(res) < len(procs):  # a rank that dies ends the run at once, with its code
            try:
                res.append(q.get(timeout=1.0))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    print(f"bench_ulysses: FAILED, ranks died (rank, exit code): {dead}")
                    return 1
        res.sort(key=lambda r: r[0])
        for p in procs:
            p.join()
    print(
        f"bench_ulysses: {args.nproc} ranks, {torch.cuda.get_device_name(0)}, torch "
        f"{torch.__version__}, NCCL {torch.cuda.nccl.version()}; transport {res[0][3]}"
    )
    bad = 0
    for i, (mode, what, _, _) in enumerate(res[0][1]):
        ok = all(r[1][i][3] for r in res)
        bad += not ok
        cols = res[0][1][i][2].keys()
        # per column the slowest rank (times) / the smallest share (hidden %)
        vals = {c: (min if c == "hidden %" else max)(r[1][i][2][c] for r in res) for c in cols}
        cells = ", ".join(f"{c} {v:.1f}{'' if c == 'hidden %' else ' us'}" for c, v in vals.items())
        print(f"{mode:8s} {what}: {cells} [{'OK' if ok else 'FAIL'}]")
    st = res[0][2]
    print(
        f"memory_stats (rank 0): {st['device_bytes'] / 2**20:.1f} MiB on the device "
        f"(sync {st['sync_bytes'] / 2**20:.1f}, async {st['async_bytes'] / 2**20:.1f}), "
        f"{st['calls']} calls"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
