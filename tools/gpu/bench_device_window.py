# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Ping-pong latency of a device ``put`` + ``signal`` through fastcomms' device window (issue 52),
against NCCL send/recv of the same bytes. Two ranks; rank 0 puts N bytes into rank 1's window
with a signal (``fastcomms.triton.put_block`` with a signal id: the bytes, then a release ADD),
rank 1 waits for it (acquire) and puts the same number of bytes back; one round trip. Variants:

- ``device persistent``: one Triton kernel doing ``--iters`` round trips (plus one first round
  trip that lines the two ranks' kernels up), timed with CUDA events and divided by the round
  trips in it: the device-side latency with the launch amortized. ``globaltimer_us`` is the same
  kernel's own clock (``%globaltimer``) over the ``--iters`` round trips after the first one
  (the first one also waits out the skew between the two ranks' launches, which the event
  figure carries divided by ``--iters`` + 1 and the clock leaves out);
- ``device launch per rt``: one launch of the same kernel per round trip, ``--iters`` launches
  back to back on the stream, CUDA events over them: the figure a caller launching a kernel per
  exchange sees (Triton's Python launch cost included where it exceeds the round trip);
- ``nccl send/recv``: ``torch.distributed.send`` / ``recv`` ping-pong on NCCL, ``--iters`` round
  trips timed with CUDA events (a launch per op, as the row above); ``nccl graph``: the same
  round trips captured in one CUDA graph and replayed (launch cost gone, as ``device
  persistent``). NCCL needs a GPU per rank: with the two ranks sharing one GPU (MPS clients) NCCL
  refuses duplicate GPUs and these rows print ``skipped`` with the reason (gloo moves the bytes
  through host memory: no comparable figure, so none is printed).

Sizes 8 B, 4 KiB, 64 KiB, 1 MiB (``--sizes``). A size above ``--slice`` bytes is split over
several programs (one 64 KiB slice each by default; the receiver waits for every slice's
signal), as NCCL spreads a large message over channels. Before timing, every size's bytes are
checked on both ranks against the peer's pattern (and the bytes past them untouched). Rounds
interleave the variants; medians over ``--rounds`` rounds after one warm-up round, each round
after a host barrier. Prints an ``env`` line, then one JSON line per (size, variant): rank 0's
median (the initiator's round trip) and both ranks'. A benchmark, not a test.

Ranks go on GPU rank % device_count (``--one-gpu``: both on GPU 0). Ranks sharing a GPU must be
MPS clients (tools/gpu/mps.sh): time-sliced, a device wait for the other rank lasts until the
next context switch; without ``CUDA_MPS_PIPE_DIRECTORY`` the script refuses (``--time-sliced``
runs anyway).

Usage: [tools/gpu/mps.sh] python3 tools/gpu/bench_device_window.py [--rounds 7] [--iters 2000]
       [--sizes 8,4096,65536,1048576] [--slice 65536] [--one-gpu] [--time-sliced]"""

import argparse
import datetime
import json
import os
import statistics
import sys
import traceback

import fastcomms.triton as fct
import torch
import triton
import triton.language as tl
from _bench_common import spawn_ranks

SIZES = (8, 4096, 65536, 1 << 20)
NCCL_SHARED_WHY = (
    "ranks share one GPU as MPS clients: NCCL refuses duplicate GPUs (two ranks on one device), "
    "and gloo moves the bytes through host memory, which is no comparable figure"
)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _round_trip(win, src_buf, lo, mine, r, want):
    """One round trip of this program's slice [lo, lo + mine): rank 0 puts it into rank 1's
    window with signal 0 and waits for rank 1's answer; rank 1 waits, then answers. ``want``:
    the signal count (every program ADDs 1 per put) that completes this round trip."""
    bad = tl.cast(0, tl.int32)
    if r == 1:
        bad = fct.wait_signal_from_block(win, 0, 0, want)
    if bad == 0:
        bad = fct.put_block(win, lo, src_buf, lo, 1 - r, mine, 0, -1)
    if bad == 0:
        if r == 0:
            bad = fct.wait_signal_from_block(win, 1, 0, want)
    return bad


@triton.jit(do_not_specialize=["nbytes", "iters", "done"])
def ping_pong(win, src_buf, nbytes, slice_bytes, iters, done, clock, rc):
    """1 + ``iters`` round trips of ``nbytes`` between ranks 0 and 1 (window offset 0 to window
    offset 0; program p carries bytes [p * slice_bytes, (p + 1) * slice_bytes)). ``done``: the
    count signal 0 holds before this launch (never reset; the host keeps it). The first round
    trip lines the two ranks' kernels up; program 0 stores the ns the other ``iters`` took in
    ``clock[0]``. A refused call or a timed-out wait stops the round trips and sets ``rc[0]``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r = fct.rank(win)
    lo = pid.to(tl.int64) * slice_bytes
    mine = tl.minimum(tl.maximum(nbytes - lo, 0), slice_bytes)
    bad = _round_trip(win, src_buf, lo, mine, r, done + programs)
    start = _globaltimer()
    for i in range(0, iters):
        if bad == 0:
            bad = _round_trip(win, src_buf, lo, mine, r, done + (i + 2) * programs)
    end = _globaltimer()
    if pid == 0:
        tl.store(clock, end - start)
    if bad != 0:
        tl.atomic_or(rc, 1)


def _pattern(rank, nbytes):
    g = torch.Generator().manual_seed(4242 + rank)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _events(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0  # µs


def _rank(rank, world, path, args, outq):
    try:
        outq.put(_measure(rank, world, path, args))
    except Exception:  # noqa: BLE001 - the parent prints it (a rank that raised puts no rows)
        outq.put({"rank": rank, "error": traceback.format_exc()})


def _measure(rank, world, path, args):
    import fastcomms
    import torch.distributed as dist

    ngpu = torch.cuda.device_count()
    shared = args.one_gpu or ngpu < world
    dev = torch.device("cuda", 0 if shared else rank % ngpu)
    torch.cuda.set_device(dev)
    store = dist.FileStore(path, world)
    timeout = datetime.timedelta(seconds=args.timeout)
    if shared:  # gloo only for the host barriers: NCCL refuses two ranks on one GPU
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("torch", store),
            rank=rank,
            world_size=world,
            timeout=2 * timeout,
        )
        ctrl = None
    else:
        dist.init_process_group(
            "nccl",
            store=dist.PrefixStore("torch", store),
            rank=rank,
            world_size=world,
            device_id=dev,
            timeout=2 * timeout,
        )
        ctrl = dist.new_group(backend="gloo", timeout=2 * timeout)

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group=ctrl)

    top = max(args.sizes)
    landing = torch.zeros(top + 64, dtype=torch.uint8, device=dev)  # 64 bytes past: untouched
    comm = None
    if shared:  # a window over a store folder (no communicator: MPS clients of one GPU)
        d = path + ".window.d"
        os.makedirs(d, exist_ok=True)
        win = fastcomms.store_window(rank, world, dev, d, "pingpong", timeout, landing)
    else:  # an nvlink communicator's window, a GPU per rank
        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world)
        comm = fastcomms.new_comm(
            "nvlink", dev, "bench_pingpong", store=dist.PrefixStore("fc", store), timeout=timeout
        )
        win = comm.new_window(landing)
    dwin = win.get_device_window(signal_count=1, counter_count=0, barrier_count=1)
    src = _pattern(rank, top).to(dev)
    src_buf = win.register_local_buffer(src)
    peer_bytes = _pattern(1 - rank, top).to(dev)
    clock = torch.zeros(1, dtype=torch.int64, device=dev)
    rc = torch.zeros(1, dtype=torch.int32, device=dev)
    done = [0]  # signal 0's count at this rank (every rank's equal after a launch)

    def launch(nbytes, programs, iters):
        ping_pong[(programs,)](
            dwin, src_buf, nbytes, args.slice, iters, done[0], clock, rc, num_warps=4
        )
        done[0] += programs * (1 + iters)

    def check_device(what):
        torch.cuda.synchronize()
        win.check_errors()  # a timed-out device wait raises TimeoutError here
        if int(rc.item()) != 0:
            raise RuntimeError(f"rank {rank}: {what}: a device call was refused or timed out")

    rows = []
    for nbytes in args.sizes:
        programs = max(1, -(-nbytes // args.slice))
        # correctness first: one round trip into a zeroed window brings the peer's bytes, and
        # not one byte past them
        landing.zero_()
        barrier()
        launch(nbytes, programs, 0)
        check_device(f"{nbytes} B check")
        got = landing[: nbytes + 64]
        assert torch.equal(got[:nbytes], peer_bytes[:nbytes]), f"rank {rank}: {nbytes} B differ"
        assert not bool(got[nbytes:].any()), f"rank {rank}: {nbytes} B: a write past the put"

        def persistent(nbytes=nbytes, programs=programs):
            launch(nbytes, programs, args.iters)

        def per_launch(nbytes=nbytes, programs=programs):
            for _ in range(args.iters):
                launch(nbytes, programs, 0)

        # (callable, round trips in one call)
        variants = {
            "device persistent": (persistent, args.iters + 1),
            "device launch per rt": (per_launch, args.iters),
        }
        skipped = {}
        if shared:
            skipped["nccl send/recv"] = skipped["nccl graph"] = NCCL_SHARED_WHY
        else:
            x = src[:nbytes].clone()
            y = torch.empty_like(x)

            def nccl_rts(n, x=x, y=y):
                for _ in range(n):
                    if rank == 0:
                        dist.send(x, 1)
                        dist.recv(y, 1)
                    else:
                        dist.recv(y, 0)
                        dist.send(x, 0)

            nccl_rts(3)  # the p2p communicator is made here, outside any timing or capture
            barrier()
            assert torch.equal(y, peer_bytes[:nbytes]), f"rank {rank}: nccl {nbytes} B differ"
            variants["nccl send/recv"] = (lambda n=args.iters: nccl_rts(n), args.iters)
            why = None
            try:
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    nccl_rts(2)  # warm-up on the capture stream
                torch.cuda.current_stream().wait_stream(s)
                barrier()
                with torch.cuda.graph(graph):
                    nccl_rts(args.iters)
            except Exception as e:  # noqa: BLE001 - printed: why the row is absent
                why = f"capture failed on rank {rank}: {type(e).__name__}: {e}"[:300]
            # both ranks replay, or neither (a lone replay would wait for sends never made)
            ok = torch.tensor([0 if why else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctrl)
            barrier()
            if int(ok) == 1:
                variants["nccl graph"] = (graph.replay, args.iters)
            else:
                skipped["nccl graph"] = why or "capture failed on the other rank"

        times = {k: [] for k in variants}
        clocks = []
        for r in range(args.rounds + 1):
            for name, (fn, rts) in variants.items():
                barrier()
                t = _events(fn) / rts
                if r > 0:
                    times[name].append(t)
                    if name == "device persistent":
                        clocks.append(int(clock.item()) / 1000.0 / args.iters)
        check_device(f"{nbytes} B timing")
        for name, ts in times.items():
            row = {
                "bytes": nbytes,
                "variant": name,
                "rank": rank,
                "median_us": statistics.median(ts),
                "rounds": len(ts),
                "round_trips_per_round": variants[name][1],
            }
            if name.startswith("device"):
                row["programs"] = programs
            if name == "device persistent":
                row["globaltimer_us"] = statistics.median(clocks)
            rows.append(row)
        for name, why in skipped.items():
            rows.append({"bytes": nbytes, "variant": name, "rank": rank, "skipped": why})
        barrier()

    barrier()
    win.deregister_local_buffer(src_buf)
    win.tensor_deregister()
    if comm is not None:
        comm.finalize()
    dist.destroy_process_group()
    return rows


def _env(args, shared):
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a torch without NCCL
        nccl = None
    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nproc": 2,
        "ranks_share_gpu": shared,
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nccl": nccl if not shared else None,
        "iters": args.iters,
        "rounds": args.rounds,
        "slice_bytes": args.slice,
    }


def _summary(rows):
    """One line per (size, variant): rank 0's median and both ranks' (rows of both ranks)."""
    by = {}
    for row in rows:
        by.setdefault((row["bytes"], row["variant"]), []).append(row)
    out = []
    for (nbytes, variant), rs in by.items():
        rs = sorted(rs, key=lambda r: r["rank"])
        if "skipped" in rs[0]:
            out.append({"bytes": nbytes, "variant": variant, "skipped": rs[0]["skipped"]})
            continue
        line = {
            "bytes": nbytes,
            "variant": variant,
            "rt_median_us": round(rs[0]["median_us"], 2),
            "per_rank_us": [round(r["median_us"], 2) for r in rs],
            "rounds": rs[0]["rounds"],
            "round_trips_per_round": rs[0]["round_trips_per_round"],
        }
        for k in ("programs", "globaltimer_us"):
            if k in rs[0]:
                line[k] = round(rs[0][k], 2) if isinstance(rs[0][k], float) else rs[0][k]
        out.append(line)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2000, help="round trips per round and variant")
    ap.add_argument(
        "--sizes",
        type=lambda s: [int(v) for v in s.split(",")],
        default=list(SIZES),
        help="bytes, comma-separated (default 8,4096,65536,1048576)",
    )
    ap.add_argument("--slice", type=int, default=65536, help="bytes per program (16-aligned)")
    ap.add_argument("--one-gpu", action="store_true", help="both ranks on GPU 0 (MPS clients)")
    ap.add_argument("--time-sliced", action="store_true", help="run sharing a GPU without MPS")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a device wait may take")
    args = ap.parse_args(argv)
    if args.slice <= 0 or args.slice % 16:
        ap.error(f"--slice must be a positive multiple of 16, got {args.slice}")
    if args.iters < 1 or args.rounds < 1 or min(args.sizes) < 1:
        ap.error("--iters, --rounds and every size must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    shared = args.one_gpu or torch.cuda.device_count() < 2
    if shared and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY") and not args.time_sliced:
        print(
            "skipped: the two ranks would share GPU 0 without MPS (time-sliced, a device wait "
            "for the other rank lasts until the next context switch): run under "
            "tools/gpu/mps.sh, or pass --time-sliced",
            file=sys.stderr,
        )
        return 2
    print("env", json.dumps(_env(args, shared)), flush=True)
    got = spawn_ranks(_rank, 2, args, timeout=600)
    errors = [g for g in got if isinstance(g, dict) and "error" in g]
    for e in errors:
        print(f"rank {e['rank']} failed:\n{e['error']}", file=sys.stderr)
    if errors:
        return 1
    for line in _summary([row for rows in got for row in rows]):
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
