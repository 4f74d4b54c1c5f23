# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Python-level Ulysses benchmark on 2+ GPUs (one rank per GPU), run by scripts/gpu.sh under
tools/gpu/exclusive.py. Sections (each against BASE = permute + torch.distributed NCCL
all_to_all_single + permute in the same run, CUDA events, every result checked bit for bit):

  anchor   the shapes of DESIGN.md's anchor table: BASE, fastcomms copying and zero-copy (auto and
           each engine) and, where it is importable (tools/gpu/build_anchor.sh builds it from its
           sdist), fast-ulysses copying and zero-copy; every variant in turn times a batch of
           back-to-back calls, 7 interleaved rounds, median per variant, the slowest rank shown
  padding  uneven shards vs the same data padded to even shards (ours and the permute path)
  overlap  the share of an async all-to-all hidden under a chain of bf16 GEMMs on the caller's
           stream, (T_gemm + T_a2a - T_both) / T_a2a from interleaved medians, for our SM and
           zero-SM engines and fast-ulysses, under a short chain (about twice the a2a) and a long
           one
  gqa      grouped-query / multi-query K and V (kv_replicas): Llama-like (32 query heads, 1, 2
           or 4 KV heads fewer than the ranks, d=128, bf16) against repeat_interleave + our own
           op and + BASE, copying and zero copy, with the bytes each reads from HBM (from the
           plan); with --share, more ranks than GPUs (round-robin; BASE needs NCCL, which wants
           one GPU per rank, so it is left out there and the default group is gloo)
and prints the group's memory_stats().
Usage: python3 tools/gpu/bench_ulysses.py [--nproc N] [--share] [--only anchor,padding,overlap,gqa]
"""

import argparse
import os
import queue
import statistics
import sys
import tempfile

import torch
import torch.multiprocessing as mp
from _bench_common import host_per_call, init_rank, ulysses_calls
from fastcomms._bench import permute_all_to_all_4d as _base  # BASE: the permute path

WARMUP, ITERS = 5, 20
ROUNDS = 7

# (mode, mode-0 geometry (b, s_local, h, d)): DESIGN.md's anchor table.
ANCHOR_SHAPES = [
    (0, (1, 64, 40, 128)),
    (0, (1, 1024, 40, 128)),
    (0, (1, 4096, 40, 128)),
    (0, (1, 37800, 40, 128)),
    (0, (1, 16380, 40, 384)),
    (0, (1, 37800, 40, 384)),
    (1, (1, 37800, 40, 128)),
    (0, (2, 8192, 32, 128)),
    (0, (4, 4096, 32, 128)),
    (1, (2, 8192, 32, 128)),
]


def _interleaved(variants, iters, rounds=ROUNDS, warmup=WARMUP):
    """Per variant (name -> (setup, fn)): median µs per call over `rounds` rounds, each round
    timing a batch of `iters` back-to-back calls of every variant in turn."""
    for setup, fn in variants.values():
        setup()
        for _ in range(warmup):
            fn()
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for k, (setup, fn) in variants.items():
            setup()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            samples[k].append(a.elapsed_time(b) * 1e3 / iters)
    return {k: statistics.median(v) for k, v in samples.items()}


def _anchor_module():
    try:
        import fast_ulysses

        return fast_ulysses
    except ImportError:
        return None


def _same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _anchor_row(g, fu, mode, geometry, size, dev, gen):
    """One shape of the anchor table: (label, {variant: µs}, every output bit-exact)."""
    b, s, h, d = geometry
    shape = (b, s, h, d) if mode == 0 else (b, s * size, h // size, d)
    x = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
    want = _base(x, mode, size)
    zo = g.empty_output(x, mode=mode)
    fz = fu.empty_output(x, mode=mode) if fu is not None else None

    def engine(e):
        return lambda: g._tune("engine", e)

    def keep():
        pass

    v = {
        "BASE": (keep, lambda: _base(x, mode, size)),
        "copy": (engine("auto"), lambda: g.all_to_all_4d(x, mode=mode)),
        "zero": (engine("auto"), lambda: g.all_to_all_4d(x, mode=mode, out=zo)),
        "zero ce": (engine("ce"), lambda: g.all_to_all_4d(x, mode=mode, out=zo)),
        "zero sm": (engine("sm"), lambda: g.all_to_all_4d(x, mode=mode, out=zo)),
        "zero hyb": (engine("hybrid"), lambda: g.all_to_all_4d(x, mode=mode, out=zo)),
    }
    if fu is not None:
        v["fu copy"] = (keep, lambda: fu.all_to_all_4d(x, mode=mode))
        v["fu zero"] = (keep, lambda: fu.all_to_all_4d(x, mode=mode, out=fz))
    ok = True
    for setup, fn in v.values():  # poisoned outputs first, then checked bit for bit
        setup()
        for buf in (zo, fz):
            if buf is not None:
                buf.view(torch.uint8).fill_(0xA5)
        ok = ok and _same(fn(), want)
    mib = x.numel() * x.element_size() / 2**20
    t = _interleaved(v, 50 if mib < 16 else 10)
    g._tune("engine", "auto")
    return f"mode {mode} {geometry} {mib:.1f} MiB", t, ok


def _anchor_section(rank, size, g, dev, gen):
    """The anchor table: rows of (label, {variant: µs}, ok)."""
    fu_mod = _anchor_module()
    fu = fu_mod.UlyssesGroup(None, device=dev) if fu_mod is not None else None
    rows = []
    for mode, geometry in ANCHOR_SHAPES:
        rows.append(_anchor_row(g, fu, mode, geometry, size, dev, gen))
    if fu is not None:
        fu.destroy()
    return rows, (f"fast-ulysses {fu_mod.__version__}" if fu_mod is not None else None)


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


HOST_SHAPES = [(1, 16, 40, 128), (1, 64, 40, 128)]


def _host_section(g, dev, gen, size):
    """Host cost per call: rows of (label, {variant: µs}, every output bit-exact)."""
    rows = []
    for geometry in HOST_SHAPES:
        b, s, h, d = geometry
        x = torch.randn((b, s, h, d), generator=gen, device=dev, dtype=torch.bfloat16)
        want = _base(x, 0, size)
        zo = g.empty_output(x)
        calls = ulysses_calls(g, x, zo, extra={"BASE": lambda x=x: _base(x, 0, size)})
        zo.view(torch.uint8).fill_(0xA5)
        ok = _same(calls["zero"](), want) and _same(zo, want)
        ok = ok and _same(calls["copy"](), want) and _same(calls["async"]().wait(), want)
        ok = ok and _same(calls["functional"](), want)
        t = {k: host_per_call(fn) for k, fn in calls.items()}
        mib = x.numel() * x.element_size() / 2**20
        rows.append((f"host per call {geometry} {mib:.2f} MiB", t, ok))
    return rows


def _overlap_section(g, dev, gen, size):
    """Async all-to-all under GEMM chains: rows of (label, {gemm, a2a, both, hidden %}, ok)."""
    fu_mod = _anchor_module()
    fu = fu_mod.UlyssesGroup(None, device=dev) if fu_mod is not None else None
    heads, d = 40, 128
    xo = torch.randn(1, 37800 // size, heads, d, generator=gen, device=dev, dtype=torch.bfloat16)
    want = _base(xo, 0, size)
    n = 4096
    a_m = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=gen) / 64
    rows = []
    lanes = [
        ("copy engines, copy-out on SMs", "ce"),
        ("SM engine", "sm"),
        ("auto", "auto"),
        ("zero-SM, lend=True", "ce-lend"),
        ("zero-SM, lend=True, memop barriers (experimental)", "ce-lend-memop"),
    ]
    if fu is not None:
        lanes.append(("fast-ulysses", None))
        lanes.append(("fast-ulysses, lend=True", "fu-lend"))
    for chain in (4, 16):

        def gemms(chain=chain):
            y = a_m
            for _ in range(chain):
                y = y @ a_m
            return y

        for label, engine in lanes:
            if engine is None:
                setup, call = (lambda: None), (lambda: fu.all_to_all_4d_async(xo))
            elif engine == "fu-lend":
                setup, call = (lambda: None), (lambda: fu.all_to_all_4d_async(xo, lend=True))
            elif engine in ("ce-lend", "ce-lend-memop"):
                # NOTE [memop barrier]: the default (kernel) barriers, or the experimental ones
                barrier = "memop" if engine == "ce-lend-memop" else "auto"
                setup, call = (
                    (lambda b=barrier: (g._tune("engine", "ce"), g._tune("barrier", b))),
                    (lambda: g.all_to_all_4d_async(xo, lend=True)),
                )
            else:
                setup, call = (
                    (lambda e=engine: (g._tune("engine", e), g._tune("barrier", "auto"))),
                    (lambda: g.all_to_all_4d_async(xo)),
                )
            try:
                setup()
            except (RuntimeError, NotImplementedError) as e:  # memop barriers refused here
                print(f"overlap  {label}: not run ({e})", flush=True)
                continue
            ok = _same(call().wait(), want)

            def both(call=call, gemms=gemms):
                w = call()
                gemms()
                w.wait()

            t = _interleaved(
                {
                    "gemm chain": (setup, gemms),
                    "a2a alone": (setup, lambda call=call: call().wait()),
                    "both": (setup, both),
                },
                iters=5,
                rounds=9,
                warmup=3,
            )
            t["hidden %"] = 100 * (t["gemm chain"] + t["a2a alone"] - t["both"]) / t["a2a alone"]
            what = f"{label}, async (1,{37800 // size},40,128) bf16 vs {chain} GEMMs {n}^3"
            rows.append((what, t, ok))
    g._tune("engine", "auto")
    g._tune("barrier", "auto")
    if fu is not None:
        fu.destroy()
    return rows


def _padding_section(g, ref, dev, gen, rank, size):
    heads, d, total = 40, 128, 75600
    base = total // size
    seq = [base + (size - 1 - 2 * p) * 600 for p in range(size)]  # uneven, same total
    seq[-1] += total - sum(seq)
    hs = [heads // size] * size
    x = torch.randn(1, seq[rank], heads, d, generator=gen, device=dev, dtype=torch.bfloat16)
    pad = max(seq)
    xp = torch.zeros(1, pad, heads, d, device=dev, dtype=torch.bfloat16)
    xp[:, : seq[rank]] = x
    got = g.all_to_all_4d(x, seq_splits=seq, head_splits=hs)
    ok = _same(got, ref.all_to_all_4d(x, seq_splits=seq, head_splits=hs))
    zo = g.empty_output(x, seq_splits=seq, head_splits=hs)
    zp = g.empty_output(xp)
    keep = lambda: None  # noqa: E731
    t = _interleaved(
        {
            "ours uneven (zero copy)": (
                keep,
                lambda: g.all_to_all_4d(x, out=zo, seq_splits=seq, head_splits=hs),
            ),
            "ours padded (zero copy)": (keep, lambda: g.all_to_all_4d(xp, out=zp)),
            "permute uneven": (keep, lambda: ref.all_to_all_4d(x, seq_splits=seq, head_splits=hs)),
            "permute padded": (keep, lambda: _base(xp, 0, size)),
        },
        iters=10,
    )
    return [(f"seq splits {seq}, 40 heads, d=128, bf16", t, ok)]


GQA_SEQ = [256, 2048, 16384, 65536]  # s_local


def _gqa_row(g, x, kv, size, shared):
    """One GQA shape: ({variant: µs, MiB read}, every output bit-exact)."""
    rep = x.repeat_interleave(kv, dim=2)
    want = g.all_to_all_4d(rep)
    zg = g.empty_output(x, kv_replicas=kv)
    zr = g.empty_output(rep)
    keep = lambda: None  # noqa: E731
    v = {
        "gqa copy": (keep, lambda: g.all_to_all_4d(x, kv_replicas=kv)),
        "rep+ours copy": (keep, lambda: g.all_to_all_4d(x.repeat_interleave(kv, dim=2))),
        "gqa zero": (keep, lambda: g.all_to_all_4d(x, kv_replicas=kv, out=zg)),
        "rep+ours zero": (keep, lambda: g.all_to_all_4d(x.repeat_interleave(kv, dim=2), out=zr)),
    }
    if not shared:
        v["rep+BASE"] = (keep, lambda: _base(x.repeat_interleave(kv, dim=2), 0, size))
    ok = True
    for _, fn in v.values():
        for buf in (zg, zr):
            buf.view(torch.uint8).fill_(0xA5)
        ok = ok and _same(fn(), want)
    mib = x.numel() * x.element_size() / 2**20
    t = _interleaved(v, 50 if mib * kv < 16 else 10)
    # bytes read from HBM per rank, from the plan: ours reads each source head once per
    # destination (kv * B); the repeat reads B and writes kv * B, then the op reads kv * B
    t["MiB read gqa"] = kv * mib
    t["MiB read rep"] = (1 + kv) * mib
    return t, ok


def _gqa_section(g, dev, gen, rank, size, shared):
    """K (or V) of (1, s_local, h, 128) bf16 with h < size KV heads: ours with kv_replicas
    against repeat_interleave + ours and + BASE. Rows of (label, {variant: µs}, ok)."""
    rows = []
    for h in (1, 2, 4):
        if h >= size or size % h:
            continue
        kv = size // h
        for s in GQA_SEQ:
            x = torch.randn(1, s, h, 128, generator=gen, device=dev, dtype=torch.bfloat16)
            t, ok = _gqa_row(g, x, kv, size, shared)
            mib = x.numel() * x.element_size() / 2**20
            rows.append((f"32q/{h}kv kv_replicas={kv} (1,{s},{h},128) {mib:.2f} MiB", t, ok))
    return rows


def _uneven_heads_section(g, dev, gen, rank, size, shared):
    """KV heads more than the ranks but not divisible by them (size + 1 heads): uneven head
    splits against padding the heads to the next multiple of size (zeros), zero copy, and the
    padded permute path. Rows of (label, {variant: µs}, ok)."""
    h = size + 1
    hs = [h // size + (1 if p < h % size else 0) for p in range(size)]
    hp = -(-h // size) * size
    rows = []
    for s in GQA_SEQ[1:]:
        x = torch.randn(1, s, h, 128, generator=gen, device=dev, dtype=torch.bfloat16)
        xp = torch.zeros(1, s, hp, 128, device=dev, dtype=torch.bfloat16)
        m, off = hp // size, 0
        for p, n in enumerate(hs):  # rank p's heads first in its padded share
            xp[:, :, p * m : p * m + n] = x[:, :, off : off + n]
            off += n
        sp = dict(seq_splits=[s] * size, head_splits=hs)
        zo, zp = g.empty_output(x, **sp), g.empty_output(xp)
        got = g.all_to_all_4d(x, **sp)
        padded = g.all_to_all_4d(xp)
        ok = _same(got, padded[:, :, : hs[rank]])  # this rank's real heads of the padded call
        keep = lambda: None  # noqa: E731
        v = {
            "uneven (zero copy)": (
                keep,
                lambda x=x, zo=zo, sp=sp: g.all_to_all_4d(x, out=zo, **sp),
            ),
            "padded (zero copy)": (keep, lambda xp=xp, zp=zp: g.all_to_all_4d(xp, out=zp)),
        }
        if not shared:
            v["padded BASE"] = (keep, lambda xp=xp: _base(xp, 0, size))
        t = _interleaved(v, 20)
        rows.append((f"{h} KV heads as {hs} vs padded to {hp}, (1,{s},{h},128) bf16", t, ok))
    return rows


def _print_gqa(rows_by_rank):
    first = rows_by_rank[0]
    bad = 0
    for i, (what, t0, _) in enumerate(first):
        t = {c: max(r[i][1][c] for r in rows_by_rank) for c in t0}
        ok = all(r[i][2] for r in rows_by_rank)
        bad += not ok
        cells = ", ".join(
            f"{c} {v:.1f}{'' if c.startswith('MiB') else ' us'}" for c, v in t.items()
        )
        gains = (
            f"rep+ours/gqa copy {t['rep+ours copy'] / t['gqa copy']:.2f}x, "
            f"zero {t['rep+ours zero'] / t['gqa zero']:.2f}x"
        )
        if "rep+BASE" in t:
            gains += f", rep+BASE/gqa zero {t['rep+BASE'] / t['gqa zero']:.2f}x"
        print(f"gqa      {what}: {cells} | {gains} [{'OK' if ok else 'FAIL'}]")
    print(
        "gqa columns: µs per call (median of interleaved rounds, slowest rank); gqa = "
        "all_to_all_4d(k, kv_replicas=R); rep+ours = all_to_all_4d(k.repeat_interleave(R, 2)); "
        "rep+BASE = the repeat then permute + NCCL all_to_all_single + permute; copy = into a "
        "fresh tensor, zero = into empty_output; MiB read = bytes each rank reads from HBM "
        "according to the plan (not measured); ratios > 1 mean the GQA path is faster"
    )
    return bad


def _rank(rank, size, path, q, only, shared=False):
    import torch.distributed as dist
    from fastcomms.ulysses import UlyssesGroup

    # NCCL refuses two ranks on one GPU: shared, a gloo default group (store and BASE-free)
    dev = init_rank(rank, size, path, "gloo" if shared else "nccl")
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    ref = None if shared else UlyssesGroup(None, device=dev, transport="collective")
    gen = torch.Generator(device=dev).manual_seed(rank)
    sections, anchor = [], None
    if "anchor" in only:
        rows, anchor = _anchor_section(rank, size, g, dev, gen)
        sections.append(("anchor", rows))
    if "padding" in only:
        sections.append(("padding", _padding_section(g, ref, dev, gen, rank, size)))
    if "overlap" in only:
        sections.append(("overlap", _overlap_section(g, dev, gen, size)))
    if "host" in only:
        sections.append(("host", _host_section(g, dev, gen, size)))
    if "gqa" in only:
        sections.append(("gqa", _gqa_section(g, dev, gen, rank, size, shared)))
        sections.append(("kv heads", _uneven_heads_section(g, dev, gen, rank, size, shared)))
    stats = g.memory_stats()
    q.put((rank, sections, stats, f"{g.transport} ({g.transport_reason})", anchor))
    g.destroy()
    dist.destroy_process_group()


def _print_anchor(rows_by_rank):
    """The anchor table: per variant the slowest rank's median, then the ratios that matter."""
    first = rows_by_rank[0]
    cols = list(first[0][1].keys())
    head = f"{'shape':42s} " + " ".join(f"{c:>9s}" for c in cols)
    ratios = ["BASE/zero", "fu/zero", "fu/copy"] if "fu zero" in cols else ["BASE/zero"]
    print(head + " | " + " ".join(f"{r:>9s}" for r in ratios))
    bad = 0
    for i, (what, _, _) in enumerate(first):
        t = {c: max(r[i][1][c] for r in rows_by_rank) for c in cols}
        ok = all(r[i][2] for r in rows_by_rank)
        bad += not ok
        rat = {
            "BASE/zero": t["BASE"] / t["zero"],
            "fu/zero": t.get("fu zero", 0) / t["zero"],
            "fu/copy": t.get("fu copy", 0) / t["copy"],
        }
        print(
            f"{what:42s} "
            + " ".join(f"{t[c]:9.1f}" for c in cols)
            + " | "
            + " ".join(f"{rat[r]:8.2f}x" for r in ratios)
            + f" [{'OK' if ok else 'FAIL'}]"
        )
    print(
        "columns: µs per call (median of interleaved rounds, slowest rank); copy/zero = "
        "fastcomms auto engine into a fresh tensor / into empty_output (zero copy); zero ce/sm/hyb "
        "= zero copy with the engine forced; fu = fast-ulysses; ratios > 1 mean fastcomms is "
        "faster"
    )
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", default="anchor,padding,overlap,gqa,host")
    ap.add_argument(
        "--share",
        action="store_true",
        help="place ranks round-robin on the GPUs (more ranks than GPUs; gqa section only)",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.share:
        if only - {"gqa"}:
            ap.error("--share runs the gqa section only (--only gqa)")
    elif torch.cuda.device_count() < args.nproc:
        print(f"SKIPPED: bench_ulysses needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(
                target=_rank, args=(r, args.nproc, os.path.join(d, "s"), q, only, args.share)
            )
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
        f"{torch.__version__}, NCCL {torch.cuda.nccl.version()}; transport {res[0][3]}; anchor: "
        f"{res[0][4] or 'not built (tools/gpu/build_anchor.sh)'}"
        + (
            "; ranks as MPS clients (tools/gpu/mps.sh)"
            if os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
            else ""
        )
    )
    bad = 0
    for j, (section, rows) in enumerate(res[0][1]):
        per_rank = [r[1][j][1] for r in res]
        if section == "anchor":
            bad += _print_anchor(per_rank)
            continue
        if section == "gqa":
            bad += _print_gqa(per_rank)
            continue
        for i, (what, t0, _) in enumerate(rows):
            ok = all(pr[i][2] for pr in per_rank)
            bad += not ok
            # per column the slowest rank (times) / the smallest share (hidden %)
            vals = {
                c: (min if c == "hidden %" else max)(pr[i][1][c] for pr in per_rank) for c in t0
            }
            cells = ", ".join(
                f"{c} {v:.1f}{'' if c == 'hidden %' else ' us'}" for c, v in vals.items()
            )
            print(f"{section:8s} {what}: {cells} [{'OK' if ok else 'FAIL'}]")
    st = res[0][2]
    print(
        f"memory_stats (rank 0): {st['device_bytes'] / 2**20:.1f} MiB on the device "
        f"(sync {st['sync_bytes'] / 2**20:.1f}, async {st['async_bytes'] / 2**20:.1f}), "
        f"{st['calls']} calls"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
