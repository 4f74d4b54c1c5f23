# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of fastcomms.moe's device transport (issue 53; NOTE [moe device transport] in
python/fastcomms/_moe_device.py): 2, 4 and 8 ranks sharing GPU 0 as MPS clients, on nvlink
communicators whose inner NCCL communicator is never made (hint nvlink.lazy_nccl: NCCL refuses
two ranks on one GPU), so the group takes the device transport (device_alltoallv_single).

Every result is compared bit for bit with the collective transport on the same data (the same
calls on CPU over torch's gloo group of the same ranks; test_moe.py holds that one to a
torch.distributed.all_to_all_single reference): rows, counts, offsets, weights, sources, FP8 rows
and scales, the combine, and the gradients of x and topk_weights (topk_weights' within float32
rounding: a sum over hidden, in the device's order); uniform, skewed and dropped
routing, k = 1, 2, 4, 8, a rank with no tokens. No host sync: dispatch and combine run under
``torch.cuda.set_sync_debug_mode("error")``, whose armed control (a ``.tolist()`` of the counts)
must raise. A CUDA graph captures one dispatch + expert + combine and is replayed with new routing
copied into the same topk tensors, each replay against the collective transport. A refusal (an
expert id out of range) gives an empty dispatch on every rank and check_errors() raises it on
every rank. Skipped (saying why) without CUDA, MPS or an nvlink build."""

import datetime
import os
import traceback

import pytest
import torch
from conftest import _hang_guard, init_rank, spawn
from test_ulysses_gpu import mps_daemon  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh; ranks as MPS clients)",
)


def _comm(rank, size, path):
    # NOTE [moe device transport opt-out] (fastcomms/moe.py): the default; an opt-out set in the
    # environment that runs the suite would turn this tier into a test of the collective one
    os.environ.pop("FASTCOMMS_MOE_DEVICE", None)
    import fastcomms
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = init_rank(rank, size, path)  # torch.distributed over gloo: the reference
    comm = fastcomms.new_comm(
        "nvlink",
        torch.device("cuda", 0),
        "moedev",
        store=dist.PrefixStore("fc", store),
        timeout=datetime.timedelta(seconds=60),
        hints={"nvlink.lazy_nccl": "1"},
    )
    return store, comm


def _run(ep, x, idx, w, wire=None, scales=False, grad=True):
    """dispatch, a row-wise expert using meta.weights, combine, and a backward: every result."""
    H, dt = ep.hidden, x.dtype
    grad = grad and not scales  # (FP8 rows kept: not differentiable)
    xg = x.clone().requires_grad_(grad)
    wg = w.clone().requires_grad_(grad)
    if x.is_cuda:  # a freed block of recv_x's size full of 0xFF (NaN in every float dtype),
        # which the caching allocator most likely hands to recv_x: a row in use left unwritten
        # then differs from the reference (stale memory would almost surely differ too)
        elt = 1 if scales else x.element_size()
        nbytes = ep.max_recv_rows(idx.shape[1]) * ep.hidden * elt
        torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=x.device)
    recv_x, meta, handle = ep.dispatch(xg, idx, wg, wire_dtype=wire, return_scales=scales)
    # rows past the counts are unspecified (NOTE [moe recv_x tail]): the rows in use are compared
    res = {"recv_x": recv_x[: int(meta.offsets[-1])], "scales": meta.scales}
    for f in ("counts", "offsets", "weights", "src"):
        res[f] = getattr(meta, f)
    if not scales:
        y = recv_x * (1 + meta.weights).unsqueeze(1).to(dt)
        out = ep.combine(y, handle)
        res["out"] = out
        if grad:
            (out.float() * torch.arange(H, device=out.device)).sum().backward()
            res["x.grad"], res["w.grad"] = xg.grad, wg.grad
    return {k: (v.detach().cpu() if v is not None else None) for k, v in res.items()}


def _compare(a, b, where):
    from test_moe import _same

    assert a.keys() == b.keys(), where
    for k in a:
        if k == "w.grad" and a[k] is not None:
            # combine's backward sums each slot's row times the output's gradient over hidden: a
            # float32 reduction whose order is the device's (torch's CPU and CUDA sums), so
            # equal within rounding, not bit for bit. Every other result is bit-exact.
            scale = float(a[k].abs().max()) if a[k].numel() else 0.0
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5 * scale, msg=str(where))
            continue
        assert (a[k] is None and b[k] is None) or _same(a[k], b[k]), (where, k)


def _exact_worker(rank, size, path, errq):
    _hang_guard()
    try:
        import torch.distributed as dist
        from fastcomms.moe import ExpertParallelGroup
        from test_moe import _inputs

        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        E, H, M, checks = 16, 64, 48, 0
        bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
        for dt in (bf16, f16, f32):
            gpu = ExpertParallelGroup(comm, E, H, max_tokens_per_rank=M, dtype=dt)
            cpu = ExpertParallelGroup(dist.group.WORLD, E, H, max_tokens_per_rank=M, dtype=dt)
            assert gpu.transport == "device", gpu.transport_reason
            assert cpu.transport == "collective"
            cases = [(1, "uniform"), (2, "skew"), (4, "drops"), (8, "uniform"), (8, "skew")]
            for i, (k, mode) in enumerate(cases):
                T = 0 if (rank == size - 1 and k == 4) else 30 + rank
                x, idx, w = _inputs(200 + i, rank, T, k, E, H, dt, mode)
                where = f"[rank {rank}/{size}] {dt} k={k} {mode} T={T}"
                a = _run(cpu, x, idx, w)
                b = _run(gpu, x.to(dev), idx.to(dev), w.to(dev))
                _compare(a, b, where)
                checks += 1
            if dt != f32:
                for wire in (torch.float8_e4m3fn, torch.float8_e5m2):
                    x, idx, w = _inputs(300, rank, 37, 3, E, H, dt, "drops")
                    for scales in (False, True):
                        a = _run(cpu, x, idx, w, wire, scales)
                        b = _run(gpu, x.to(dev), idx.to(dev), w.to(dev), wire, scales)
                        _compare(a, b, f"[rank {rank}] FP8 {wire} return_scales={scales}")
                        checks += 1
            gpu.check_errors()  # nothing flagged
        # a refusal: an empty dispatch on every rank, raised by check_errors on every rank
        ep = ExpertParallelGroup(comm, E, H, max_tokens_per_rank=M, dtype=f32)
        idx = torch.zeros(8, 2, dtype=torch.int64, device=dev)
        idx[:, 1] = 1
        if rank == size - 1:
            idx[2, 1] = E
        recv_x, meta, handle = ep.dispatch(torch.randn(8, H, device=dev), idx)
        assert int(meta.counts.sum()) == 0
        with pytest.raises(ValueError, match=rf"rank {size - 1}'s topk_idx names expert {E}"):
            ep.check_errors()
        comm.finalize()
        print(f"[rank {rank}/{size}] moe device transport: {checks} cases bit-exact")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _graph_worker(rank, size, path, errq):
    """No host sync in dispatch + combine (sync debug mode, armed control), then one CUDA graph
    captured and replayed with new routing copied into the same topk tensors."""
    _hang_guard()
    try:
        import torch.distributed as dist
        from fastcomms.moe import ExpertParallelGroup
        from test_moe import _inputs

        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        E, H, M, T, k, dt = 16, 128, 64, 64, 4, torch.bfloat16
        gpu = ExpertParallelGroup(comm, E, H, max_tokens_per_rank=M, dtype=dt)
        cpu = ExpertParallelGroup(dist.group.WORLD, E, H, max_tokens_per_rank=M, dtype=dt)
        assert gpu.transport == "device", gpu.transport_reason

        def step(x, idx, w):
            recv_x, meta, handle = gpu.dispatch(x, idx, w)
            y = recv_x * (1 + meta.weights).unsqueeze(1).to(dt)
            return recv_x, meta.counts, gpu.combine(y, handle)

        x, idx, w = (t.to(dev) for t in _inputs(400, rank, T, k, E, H, dt, "uniform"))
        step(x, idx, w)  # eager warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                recv_x, counts, out = step(x, idx, w)
            with pytest.raises(RuntimeError, match="synchroniz"):
                counts.tolist()  # the control: a host read of the counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _compare(
            _run(cpu, *(t.cpu() for t in (x, idx, w)), grad=False),
            _run(gpu, x, idx, w, grad=False),
            "eager under sync debug mode",
        )
        # the graph: static inputs, routing replaced between replays
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(x, idx, w)  # warm-up on the capture's side stream
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                g_recv, g_counts, g_out = step(x, idx, w)
            for i, mode in enumerate(("skew", "drops", "uniform", "skew")):
                x2, idx2, w2 = _inputs(500 + i, rank, T, k, E, H, dt, mode)
                x.copy_(x2)
                idx.copy_(idx2)
                w.copy_(w2)
                g.replay()
                torch.cuda.synchronize()
                want = _run(cpu, x2, idx2, w2, grad=False)
                n = int(want["offsets"][-1])
                from test_moe import _same

                where = f"[rank {rank}/{size}] replay {i} ({mode})"
                assert _same(g_recv.cpu()[:n], want["recv_x"][:n]), where
                assert torch.equal(g_counts.cpu(), want["counts"]), where
                assert _same(g_out.cpu(), want["out"]), where
        gpu.check_errors()
        comm.finalize()
        print(f"[rank {rank}/{size}] moe device: no host sync; graph replayed 4 routings exactly")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _guard_worker(rank, size, path, errq):
    """Nothing written past a receive buffer: every receive buffer of the device transport's
    all-to-all-vs is placed between poisoned guard bytes, through dispatches and combines whose
    routing fills a rank to its capacity (every token to one rank's experts), drops, skew, and a
    refused overflow (one rank dispatches more than max_tokens_per_rank): the guards still hold
    their poison and the refusal names the numbers on every rank. The armed control moves the
    guard's boundary one row into each buffer, on a routing that fills them: it must trip."""
    _hang_guard()
    try:
        from fastcomms.moe import ExpertParallelGroup
        from test_moe import _inputs

        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        E, H, M, k, dt = 8, 64, 32, 2, torch.bfloat16
        ep = ExpertParallelGroup(comm, E, H, max_tokens_per_rank=M, dtype=dt)
        assert ep.transport == "device", ep.transport_reason
        G, POISON = 512, 0xA5
        real, guards, short = ep._transport.a2av, [], [False]

        def guarded(out, inp, out_splits, in_splits, move=None):
            nb = out.numel() * out.element_size()
            big = torch.full((nb + 2 * G,), POISON, dtype=torch.uint8, device=out.device)
            inner = big[G : G + nb].view(out.dtype).view(out.shape)
            (move or real)(inner, inp, out_splits, in_splits)
            # the control moves the trailing guard's start onto the buffer's last row (rows: the
            # uint8 buffers), which a routing at capacity writes
            lost = nb // out.shape[0] if short[0] and out.dtype == torch.uint8 else 0
            guards.append(torch.cat([big[:G], big[G + nb - lost :]]))
            out.copy_(inner)

        real_index = ep._transport.a2av_index  # the combine's exchange (NOTE [indexed push])

        def guarded_index(out, inp, index, out_splits, in_splits):
            guarded(
                out, inp, out_splits, in_splits, lambda o, i, os, s: real_index(o, i, index, os, s)
            )

        ep._transport.a2av = guarded
        ep._transport.a2av_index = guarded_index

        def calls(cases):
            for i, (T, mode) in enumerate(cases):
                x, idx, w = _inputs(700 + i, rank, T, k, E, H, dt, mode)
                if mode == "one rank":  # every token to rank 0's experts: its rows at capacity
                    idx = torch.stack([torch.zeros(T), torch.ones(T)], 1).long()
                recv_x, meta, handle = ep.dispatch(x.to(dev), idx.to(dev), w.to(dev))
                ep.combine(recv_x, handle)

        calls([(M, "one rank"), (M, "skew"), (M - 3, "drops"), (0, "uniform")])
        torch.cuda.synchronize()
        ep.check_errors()
        assert guards and all(bool((g == POISON).all()) for g in guards), "a guard was written"
        # a refused overflow: nothing moves, every rank raises the numbers
        guards.clear()
        T = M + 5 if rank == size - 1 else M
        calls([(T, "uniform")])
        with pytest.raises(ValueError, match=rf"rank {size - 1} dispatches {M + 5} tokens"):
            ep.check_errors()
        torch.cuda.synchronize()
        assert all(bool((g == POISON).all()) for g in guards), "a guard was written (overflow)"
        # the control: the guard check with its boundary one row into each receive buffer, on a
        # routing that fills them (every slot goes to rank 0 and comes back): must trip
        guards.clear()
        short[0] = True
        calls([(M, "one rank")])
        torch.cuda.synchronize()
        ep.check_errors()
        assert not all(bool((g == POISON).all()) for g in guards), "the armed control passed"
        comm.finalize()
        print(f"[rank {rank}/{size}] moe device: guards intact in 5 calls; the control tripped")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _needs_nvlink():
    import fastcomms

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend")


@pytest.mark.parametrize("size", [2, 4, 8])
def test_moe_device_bit_exact(mps_daemon, size):  # noqa: F811
    _needs_nvlink()
    spawn(_exact_worker, size, timeout=300)


@pytest.mark.parametrize("size", [2, 4])
def test_moe_device_no_sync_and_graph(mps_daemon, size):  # noqa: F811
    _needs_nvlink()
    spawn(_graph_worker, size, timeout=300)


def test_moe_device_guards(mps_daemon):  # noqa: F811
    _needs_nvlink()
    spawn(_guard_worker, 2, timeout=300)


# -- the plan kernels against the torch plan (NOTE [moe plan kernels]) ----------------------------
def _plan_idx(gen, T, k, E, mode):
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :k]
    if mode == "skew":  # every token to experts 0..k-1 (all on rank 0 when L >= k)
        idx = torch.arange(k).expand(T, k).clone()
    if mode in ("drops", "bad", "dup") and T:
        idx[torch.rand(T, k, generator=gen) < 0.3] = -1
    if mode == "bad" and T:
        t, j = (
            int(torch.randint(T, (1,), generator=gen)),
            int(torch.randint(k, (1,), generator=gen)),
        )
        idx[t, j] = E if t % 2 else -2
    if mode == "dup" and T and k > 1:
        t = int(torch.randint(T, (1,), generator=gen))
        idx[t, 1] = idx[t, 0] = E - 1
    return idx


def _plan_equal(a, b):
    return all(
        (x is None and y is None)
        or (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def test_moe_plan_kernels_match_torch():
    """The three plan kernels give the torch plan's results field for field: random, skewed,
    dropped, refused (out of range, duplicate, overflow) routing, 1 to 1024 ranks and local
    experts, aligned and unaligned metadata; the control (one slot moved) must differ."""
    from fastcomms import _C
    from fastcomms._moe_collective import BAD_EXPERT, DUPLICATE, OVERFLOW
    from fastcomms._moe_device import expert_torch, home_torch, send_torch

    if not _C._moe_has_row_kernels():
        pytest.skip("this build has no CUDA row kernels")
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    shapes = [(1, 4, 0, 2), (1, 8, 33, 8), (2, 8, 128, 8), (3, 5, 77, 4), (4, 16, 1000, 8)]
    shapes += [(8, 32, 4096, 8), (16, 2, 300, 2), (5, 1, 64, 1), (64, 4, 500, 8), (2, 1024, 50, 4)]
    shapes += [(1024, 1, 40, 8), (1024, 1, 300, 8), (2, 1024, 600, 4)]  # 1024 keys, many blocks
    checks = 0
    for P, L, T, k in shapes:
        E = P * L
        for mode in ("uniform", "skew", "drops", "bad", "dup", "overflow"):
            where = f"P={P} L={L} T={T} k={k} {mode}"
            idx = _plan_idx(gen, T, k, E, mode).to(dev)
            M = max(T - 1, 0) if mode == "overflow" else T + 3
            args = (P, L, E, M)
            ref = home_torch(idx, *args)
            got = _C._moe_plan_home(idx, *args, OVERFLOW, BAD_EXPERT, DUPLICATE)
            assert _plan_equal(ref, got), f"home: {where}"
            head, owner, local, send_tok, send_dest = ref
            if mode == "uniform" and T > 1 and P > 1:  # control: one slot moved to another rank
                moved = idx.clone()
                moved[T // 2, 0] = (moved[T // 2, 0] + L) % E
                if moved[T // 2].unique().numel() == k:
                    bad = _C._moe_plan_home(moved, *args, OVERFLOW, BAD_EXPERT, DUPLICATE)
                    assert not _plan_equal(ref, bad), f"control: {where}"
            # send: peers' counts at random, now and then a peer's refusal; a flag already set
            peers = head.clone()
            peers[:, 0] = torch.randint(0, 50, (P,), generator=gen).to(dev)
            if torch.rand((), generator=gen) < 0.3:
                peers[int(torch.randint(P, (1,), generator=gen)), 1] = OVERFLOW
            flags = torch.zeros(5, dtype=torch.int64, device=dev)
            if torch.rand((), generator=gen) < 0.2:
                flags.copy_(torch.tensor([DUPLICATE, 1, 2, 3, 4]))
            scales = torch.rand(T, generator=gen).to(dev) if mode != "skew" else None
            weights = torch.rand(T, k, generator=gen).to(dev) if mode != "drops" else None
            row_bytes = 6 if mode in ("bad", "dup") else 8  # unaligned and aligned metadata
            S = send_tok.shape[0]
            outs = []
            for fn in (send_torch, _C._moe_plan_send):
                o, f = owner.clone(), flags.clone()
                send = torch.zeros((S, row_bytes + 4 * (2 + 2 * k)), dtype=torch.uint8, device=dev)
                r = fn(
                    peers, head, o, local, send_tok, send_dest, scales, weights, f, send, row_bytes
                )
                n = int(r[4])
                outs.append((*r, o, f, send[:n, row_bytes:]))
            assert _plan_equal(*outs), f"send: {where}"
            # expert: received metadata (distinct local experts per row, some not this rank's)
            R = P * max(M, 1)
            recv = torch.randint(0, 256, (R, row_bytes + 4 * (2 + 2 * k)), dtype=torch.uint8)
            meta = torch.empty((R, 2 + 2 * k), dtype=torch.int32)
            meta[:, 0] = torch.randint(0, 1 << 20, (R,), generator=gen, dtype=torch.int32)
            meta[:, 1] = torch.rand(R, generator=gen).view(torch.int32)
            meta[:, 2 : 2 + k] = torch.rand(R, max(k, L) + 1, generator=gen).argsort(1)[:, :k] - 1
            if mode == "skew":
                meta[:, 2] = 0
                meta[:, 3 : 2 + k] = -1
            meta[:, 2 + k :] = torch.rand(R, k, generator=gen).view(torch.int32)
            recv[:, row_bytes:] = meta.view(torch.uint8)
            split = torch.randint(0, max(M, 1) + 1, (P,), generator=gen)
            if mode == "drops":
                split[::2] = 0
            cap = R * min(k, L)
            if mode == "overflow":  # a capacity below the pairs in use: both cut at it alike
                cap = max(R * k // 4, 1)
            results = [
                fn(recv.to(dev), row_bytes, split.to(dev), k, L, cap, mode != "uniform")
                for fn in (expert_torch, _C._moe_plan_expert)
            ]
            assert _plan_equal(*results), f"expert: {where}"
            checks += 1
    assert checks == 6 * len(shapes)


def test_gather_dequant_matches_dequantize():
    """NOTE [moe row kernels]: the fused gather + dequantize of FP8 rows against the FP8 wire's
    dequantize of the gathered rows, bit for bit: every output dtype, both wires, rows that take
    the vector path and rows that cannot, a row pitch wider than the row, an index of -1 (a zero
    row), counts below, at and past the rows; rows from the count on keep their poison."""
    from fastcomms import _C

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    checks = 0
    for wire in (torch.float8_e4m3fn, torch.float8_e5m2):
        for out_dt in (torch.bfloat16, torch.float16, torch.float32):
            for d, pad in ((64, 24), (37, 3)):
                n, rows = 9, 11
                raw = torch.randint(0, 256, (rows, d + pad), dtype=torch.uint8, generator=g)
                src = raw.to(dev)[:, :d].view(wire)
                index = torch.randint(0, rows, (n,), generator=g)
                index[3] = -1
                index = index.to(dev)
                scales = (torch.rand(n, generator=g) * 4).to(dev)
                ref = torch.empty((n, d), dtype=out_dt, device=dev)
                q = src[index.clamp(min=0)].contiguous()
                _C._fp8_dequantize(q, scales, ref)
                ref[3] = 0
                for count in (None, 0, 5, n, n + 4):
                    out = torch.empty((n, d), dtype=out_dt, device=dev)
                    out.view(torch.uint8).fill_(0xA5)
                    c = None if count is None else torch.tensor([count], device=dev)
                    _C._moe_gather_dequant(out, src, scales, index, c)
                    lim = n if count is None else min(count, n)
                    got, want = out.cpu().view(torch.uint8), ref.cpu().view(torch.uint8)
                    assert torch.equal(got[:lim], want[:lim]), (wire, out_dt, d, count)
                    assert bool((got[lim:] == 0xA5).all()), (wire, out_dt, d, count, "tail")
                    checks += 1
                # the control: other scales give other bits, so the comparison above can fail
                other = torch.empty_like(out)
                _C._moe_gather_dequant(other, src, scales * 3, index, None)
                assert not torch.equal(other.cpu().view(torch.uint8), ref.cpu().view(torch.uint8))
    with pytest.raises(ValueError, match="scales must be contiguous Float of 4 values"):
        _C._moe_gather_dequant(
            torch.empty((4, 8), device=dev),
            torch.empty((6, 8), dtype=torch.float8_e4m3fn, device=dev),
            torch.ones(3, device=dev),
            torch.zeros(4, dtype=torch.int64, device=dev),
        )
    assert checks == 60
