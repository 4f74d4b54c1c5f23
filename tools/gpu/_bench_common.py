# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What the Python benchmarks in tools/gpu share: starting N spawned ranks over a FileStore and
collecting what they put on a queue, a rank's device and default group, the ``env`` line, the
Ulysses calls whose host cost is timed, and the device time per call replayed from a CUDA graph.
Imported by the scripts beside it (``python3 tools/gpu/X.py`` puts tools/gpu on the path); what
`fastcomms bench` shares with them is in python/fastcomms/_bench.py; the host-time sampler is
here."""

import json
import os
import statistics
import tempfile
import time

import torch


def spawn_ranks(target, nproc, args, results=None, timeout=300):
    """Starts ``target(rank, nproc, store_path, args, outq)`` in ``nproc`` spawned processes
    (``store_path`` a fresh FileStore path) and returns the first ``results`` items (default
    ``nproc``) put on ``outq``, each awaited ``timeout`` seconds; then joins every rank (60 s)."""
    import torch.multiprocessing as mp

    path = os.path.join(tempfile.mkdtemp(), "store")
    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, nproc, path, args, outq)) for r in range(nproc)]
    for p in procs:
        p.start()
    got = [outq.get(timeout=timeout) for _ in range(nproc if results is None else results)]
    for p in procs:
        p.join(timeout=60)
    return got


def init_rank(rank, world, path, backend="gloo"):
    """Rank ``rank`` of ``world`` on GPU rank % device_count, with torch's default group
    (``backend``; NCCL bound to the device) over a FileStore at ``path``. Returns the device."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    store = dist.FileStore(path, world)
    if backend == "nccl":
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=dev)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return dev


def print_env(nproc):
    """Prints the line ``env {json}``: the GPUs, the rank count, whether the ranks are MPS
    clients (tools/gpu/mps.sh) and torch's version."""
    env = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nproc": nproc,
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "torch": torch.__version__,
    }
    print("env", json.dumps(env))


def ulysses_calls(g, x, zo, extra=None):
    """The calls whose host cost is timed, by name: ``g``'s zero-copy (into ``zo``), copying and
    async call and the functional form on ``x``, then ``extra`` (name -> fn), then ``torch add``
    (the floor: one small torch op)."""
    from fastcomms.ulysses import all_to_all_4d as functional

    return {
        "zero": lambda: g.all_to_all_4d(x, out=zo),
        "copy": lambda: g.all_to_all_4d(x),
        "async": lambda: g.all_to_all_4d_async(x),
        "functional": lambda: functional(x, g),
        **(extra or {}),
        "torch add": lambda: torch.add(x, 1),
    }


def graph_per_call(
    g, x, zo, want, calls=20, replays=50, rounds=9, barrier=None, message="graph replay result"
):
    """Device µs per zero-copy call ``g.all_to_all_4d(x, out=zo)`` replayed from a CUDA graph:
    3 warm-up calls on a side stream, ``calls`` calls captured in one graph, one replay checked
    against ``want`` (an AssertionError with ``message`` if it differs), then ``rounds`` rounds
    of ``replays`` replays timed with CUDA events, the median. ``barrier`` (several ranks) lines
    the ranks up before the capture and before the checked replay (each after a device sync),
    and before every round."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            g.all_to_all_4d(x, out=zo)
    torch.cuda.current_stream().wait_stream(s)
    if barrier is not None:
        torch.cuda.synchronize()
        barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            g.all_to_all_4d(x, out=zo)
    zo.zero_()
    if barrier is not None:
        torch.cuda.synchronize()
        barrier()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(zo, want), message
    times = []
    for _ in range(rounds):
        if barrier is not None:
            barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (replays * calls))
    return statistics.median(times)


def host_per_call(fn, iters=200, rounds=7, warmup=20):
    """Median µs of host time per call of ``fn`` over ``rounds`` rounds of ``iters``
    back-to-back calls, timed with perf_counter and nothing synchronized inside a round (the GPU
    runs behind, as in a training step): what an eager caller pays to issue one call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t) * 1e6 / iters)
        torch.cuda.synchronize()
    return statistics.median(samples)


def print_slowest_rank(got, keep=()):
    """Prints one JSON line per (routing, variant) from every rank's rows (each a dict with
    routing, variant, rank and median_us, or skipped): the slowest rank's median (a collective
    ends with its slowest rank), every rank's, and the fields named in ``keep`` where the rows
    have them (one value where the ranks agree, else every rank's)."""
    by = {}
    for rows in got:
        for row in rows:
            by.setdefault((row["routing"], row["variant"]), []).append(row)
    for (routing, variant), rs in by.items():
        line = {"routing": routing, "variant": variant}
        if "skipped" in rs[0]:
            line["skipped"] = rs[0]["skipped"]
        else:
            line["median_us_slowest_rank"] = round(max(r["median_us"] for r in rs), 1)
            line["per_rank_us"] = [
                round(r["median_us"], 1) for r in sorted(rs, key=lambda r: r["rank"])
            ]
            for k in keep:  # one value where every rank has the same, else every rank's
                vals = [r[k] for r in sorted(rs, key=lambda r: r["rank"]) if k in r]
                if vals:
                    line[k] = vals[0] if len(set(vals)) == 1 else vals
        print(json.dumps(line))
