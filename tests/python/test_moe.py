# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms.moe on CPU over gloo (issue 53, the collective path).

One spawned world of 4 runs everything, to keep the file quick: expert-parallel groups of 2, 3
and 4 ranks (over a fastcomms communicator, a torch.distributed ProcessGroup, a 1-D DeviceMesh and
the default group), each with many routings: uniform, skewed (every token to one expert), dropped
slots (-1), k = 1..8, a rank with no tokens. Dispatch is checked bit-exact (bfloat16, float16,
float32, and the FP8 wire) against a reference built from torch.distributed.all_to_all_single and
Python-sorted permutes, crossing once per (token, slot); combine bit-exact against one process's
slot-order float32 sum; async forms against the sync ones; gradients (x, topk_weights, expert
weights, through meta.weights too) against a one-process autograd reference; the refusals
(overflow, a bad expert id, a duplicate) raised on every rank, the group usable after; and the
example's training (examples/moe_layer.py) against its one-process losses. Armed control: the
combine check must see a reference with one slot's weight moved."""

import contextlib
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location(
        "moe_layer", os.path.join(ROOT, "examples", "moe_layer.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bits(t):
    return (
        t.contiguous().view(torch.uint8)
        if t.element_size() == 1
        else t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    )


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# -- inputs every rank can make for every rank ---------------------------------------------------
def _routing(g, T, k, E, mode):
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k]  # k distinct experts per token
    if mode == "skew":  # every token's first slot on expert 0
        zero = idx == 0
        idx[zero] = idx[:, :1].expand_as(idx)[zero]  # swap expert 0 into slot 0
        idx[:, 0] = 0
    elif mode == "drops":
        idx[torch.rand(T, k, generator=g) < 0.35] = -1
    elif mode == "all-dropped":
        idx[:] = -1
    return idx


def _inputs(case, rank, T, k, E, H, dtype, mode):
    g = torch.Generator().manual_seed(1000 * case + rank)
    x = (torch.randn(T, H, generator=g) * 4).to(dtype)
    idx = _routing(g, T, k, E, mode)
    w = torch.rand(T, k, generator=g)
    return x, idx, w


# -- the references ------------------------------------------------------------------------------
def _ref_dispatch(x, idx, w, P, L, pg):
    """(rows, local expert, src rank, src pos, slot, weight) in the documented order, built from
    one all_to_all_single per (token, slot) pair (no once-per-rank dedup) and a Python sort."""
    import torch.distributed as dist

    T, k = idx.shape
    pairs = sorted(
        (int(idx[t, j]) // L, t, j) for t in range(T) for j in range(k) if idx[t, j] >= 0
    )
    send = torch.tensor([sum(1 for p in pairs if p[0] == d) for d in range(P)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    width = x.shape[1] * x.element_size()
    rows = x[torch.tensor([t for _, t, _ in pairs], dtype=torch.int64)]
    b = rows.contiguous().view(torch.uint8).reshape(len(pairs), width)
    ints = torch.tensor(
        [[t, j, int(idx[t, j]) % L] for _, t, j in pairs], dtype=torch.int64
    ).reshape(-1, 3)
    wts = torch.tensor([float(w[t, j]) for _, t, j in pairs], dtype=torch.float32)
    n = int(recv.sum())
    rb = torch.empty((n, width), dtype=torch.uint8)
    ri = torch.empty((n, 3), dtype=torch.int64)
    rw = torch.empty(n, dtype=torch.float32)
    for out, inp in ((rb, b), (ri, ints), (rw, wts)):
        dist.all_to_all_single(out, inp, recv.tolist(), send.tolist(), group=pg)
    src = torch.repeat_interleave(torch.arange(P), recv)
    order = sorted(
        range(n), key=lambda i: (int(ri[i, 2]), int(src[i]), int(ri[i, 0]), int(ri[i, 1]))
    )
    got_rows = rb[order].view(x.dtype).reshape(n, *x.shape[1:]) if n else x[:0]
    return got_rows, ri[order, 2], src[order], ri[order, 0], ri[order, 1], rw[order]


def _expert_fn(recv_x, offsets, experts, out_dtype):
    """A row-wise 'expert' whose home-side value is known: row * (1 + e / 8) in float32."""
    y = torch.zeros(recv_x.shape, dtype=out_dtype)
    b = offsets.tolist()
    for i, e in enumerate(experts):
        y[b[i] : b[i + 1]] = (recv_x[b[i] : b[i + 1]].float() * (1 + e / 8)).to(out_dtype)
    return y


def _ref_combine(x_seen, idx, w, out_dtype, y_dtype):
    """One process, slot order, float32 (NOTE [moe combine order])."""
    acc = torch.zeros(x_seen.shape, dtype=torch.float32)
    for j in range(idx.shape[1]):
        e = idx[:, j]
        y = (x_seen.float() * (1 + e.clamp(min=0).float() / 8).unsqueeze(1)).to(y_dtype)
        acc = acc + torch.where(e >= 0, w[:, j], 0).unsqueeze(1) * y.float()
    return acc.to(out_dtype)


# -- the checks ----------------------------------------------------------------------------------
def _wire_ref(x, wire):
    from fp8_reference import dequantize_reference, quantize_reference

    q, s = quantize_reference(x, wire)
    return q, s, dequantize_reference(q, s, x.dtype)


def _case(ep, pg, case, rank, P, T, k, dtype, mode, wire=None, y_dtype=None, async_op=False):
    E, H, L = ep.num_experts, ep.hidden, ep.num_local_experts
    x, idx, w = _inputs(case, rank, T, k, E, H, dtype, mode)
    t = ep._transport
    sent, a2a = [], t._a2a_v
    t._a2a_v = lambda out, inp, *a: sent.append(inp.shape[0]) or a2a(out, inp, *a)
    if async_op:
        work = ep.dispatch(x, idx, w, wire_dtype=wire, async_op=True)
        recv_x, meta, handle = work.wait()
        assert work.is_completed()
    else:
        recv_x, meta, handle = ep.dispatch(x, idx, w, wire_dtype=wire)
    del t._a2a_v
    # a token crosses once to each rank holding any of its experts (the header, then the rows)
    ranks = {(i, int(idx[i, j]) // L) for i, j in (idx >= 0).nonzero().tolist()}
    assert sent == [P, len(ranks)], (sent, len(ranks))
    x_seen = x if wire is None else _wire_ref(x, wire)[2]
    rows, e, src, pos, slot, rw = _ref_dispatch(x_seen, idx, w, P, L, pg)
    n = len(rows)
    where = f"[rank {rank}/{P}] case {case} ({mode}, k={k}, {dtype}, wire={wire})"
    assert recv_x.shape == (ep.max_recv_rows(k), H), where
    assert _same(recv_x[:n], rows), where
    assert torch.equal(meta.counts, torch.bincount(e, minlength=L).to(torch.int32)), where
    assert meta.offsets.tolist() == [0, *torch.bincount(e, minlength=L).cumsum(0).tolist()], where
    assert _same(meta.weights[:n], rw), where
    assert torch.equal(meta.src[:n], torch.stack([src, pos], 1)), where
    assert torch.equal(recv_x[n:], torch.zeros_like(recv_x[n:])), where  # (collective path)
    # combine
    y_dtype = y_dtype or dtype
    y = _expert_fn(recv_x, meta.offsets, list(ep.local_experts), y_dtype)
    if async_op:
        work = ep.combine(y, handle, async_op=True)
        out = work.wait()
    else:
        out = ep.combine(y, handle)
    ref = _ref_combine(x_seen, idx, w, dtype, y_dtype)
    assert _same(out, ref), (where, (out.float() - ref.float()).abs().max())
    if T and (idx >= 0).any():  # armed control: the same check sees one slot's weight moved
        w2 = w.clone()
        t, j = (idx >= 0).nonzero()[0].tolist()
        w2[t, j] += 0.5
        assert not _same(out, _ref_combine(x_seen, idx, w2, dtype, y_dtype)), where
    # explicit weights equal to the dispatch's: the same bits
    assert _same(ep.combine(y, handle, weights=w), out), where
    return 1


def _fp8_case(ep, pg, case, rank, P):
    """return_scales=True: FP8 rows and scales bit-exact against the torch reference, and the
    dequantized rows within the format's step of x."""
    E, H, L, k = ep.num_experts, ep.hidden, ep.num_local_experts, 2
    x, idx, w = _inputs(case, rank, 6, k, E, H, torch.bfloat16, "drops")
    wire = torch.float8_e4m3fn
    recv_q, meta, _ = ep.dispatch(x, idx, w, wire_dtype=wire, return_scales=True)
    q, s, _ = _wire_ref(x, wire)
    qrows, e, src, pos, slot, _ = _ref_dispatch(q, idx, w, P, L, pg)
    n = len(qrows)
    assert recv_q.dtype == wire and _same(recv_q[:n], qrows)
    # the scales of the rows' tokens: gather them the same way
    srows = _ref_dispatch(s.unsqueeze(1), idx, w, P, L, pg)[0].reshape(-1)
    assert _same(meta.scales[:n], srows)
    # the format's step: e4m3 keeps 3 mantissa bits (a relative half-step 2^-4), subnormals
    # below 2^-6 * scale have an absolute step of 2^-9 * scale; plus bfloat16's own rounding
    xs = _ref_dispatch(x.float(), idx, w, P, L, pg)[0]
    deq = recv_q[:n].float() * meta.scales[:n].unsqueeze(1)
    bound = xs.abs() * (2**-4 + 2**-8) + meta.scales[:n].unsqueeze(1) * 2**-9
    assert ((deq - xs).abs() <= bound).all(), (deq - xs).abs().max()
    # FP8 forward, the gradient in its own dtype (straight through the quantization): the same
    # bits as without the wire
    grads = []
    for wd in (wire, None):
        xg = x.clone().requires_grad_()
        recv_x, meta, handle = ep.dispatch(xg, idx, w, wire_dtype=wd)
        (ep.combine(recv_x * 3, handle).float() * torch.arange(H)).sum().backward()
        grads.append(xg.grad)
    assert _same(grads[0], grads[1])
    with pytest.raises(RuntimeError, match="return_scales=True is not differentiable"):
        ep.dispatch(x.requires_grad_(), idx, w, wire_dtype=wire, return_scales=True)
    return 1


def _grad_case(ep, case, rank, P, T_of):
    """Gradients of x, topk_weights and the local experts' weights through dispatch, an expert
    that also uses meta.weights, and combine, against one process's autograd (float64)."""
    E, H = ep.num_experts, ep.hidden
    k, dt = min(3, E), torch.float64
    ins = [_inputs(case, r, T_of(r), k, E, H, dt, "drops") for r in range(P)]
    g = torch.Generator().manual_seed(case)
    W = torch.randn(E, H, H, generator=g, dtype=dt)
    cot = [torch.randn(T_of(r), H, generator=g, dtype=dt) for r in range(P)]

    # fastcomms
    x, idx, w = (t.clone() for t in ins[rank])
    x.requires_grad_()
    w.requires_grad_()
    Wl = W[ep.local_experts.start : ep.local_experts.stop].clone().requires_grad_()
    recv_x, meta, handle = ep.dispatch(x, idx, w)
    b = meta.offsets.tolist()
    parts = [recv_x[b[i] : b[i + 1]] @ Wl[i] for i in range(len(Wl))]
    parts.append(recv_x[b[-1] :] * 0)
    y = torch.cat(parts) * (1 + meta.weights).unsqueeze(1).to(dt)
    out = ep.combine(y, handle)
    (out * cot[rank]).sum().backward()

    # one process
    xs = [i[0].clone().requires_grad_() for i in ins]
    ws = [i[2].clone().requires_grad_() for i in ins]
    Wr = W.clone().requires_grad_()
    total = 0
    for r in range(P):
        acc = torch.zeros(T_of(r), H, dtype=dt)
        for j in range(k):
            e = ins[r][1][:, j]
            keep = e >= 0
            ye = torch.einsum("th,thg->tg", xs[r], Wr[e.clamp(min=0)])
            ye = ye * (1 + ws[r][:, j]).unsqueeze(1).to(dt)
            acc = acc + torch.where(keep, ws[r][:, j], 0).unsqueeze(1).to(dt) * ye
        total = total + (acc * cot[r]).sum()
    total.backward()
    lo, hi = ep.local_experts.start, ep.local_experts.stop
    for got, want, name in (
        (x.grad, xs[rank].grad, "x"),
        (w.grad, ws[rank].grad, "topk_weights"),
        (Wl.grad, Wr.grad[lo:hi], "expert weights"),
    ):
        assert got is not None and got.shape == want.shape, name
        tol = 1e-9 if want.dtype == torch.float64 else 1e-5  # (topk_weights: float32)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
    return 1


def _refusals(ep, rank, P):
    E, H, m = ep.num_experts, ep.hidden, ep.max_tokens_per_rank
    x = torch.arange(m * H, dtype=torch.float32).view(m, H)
    idx = torch.zeros(m, 1, dtype=torch.int64)
    big = torch.zeros(m + 3, H)
    if rank == 1:  # one rank overflows: every rank raises, naming rank 1 and the numbers
        args = (big, torch.zeros(m + 3, 1, dtype=torch.int64))
    else:
        args = (x, idx)
    with pytest.raises(
        ValueError, match=rf"rank 1 dispatches {m + 3} tokens, more than max_tokens_per_rank={m}"
    ):
        ep.dispatch(*args)
    bad = idx.clone()
    if rank == P - 1:
        bad[2, 0] = E
    with pytest.raises(ValueError, match=rf"rank {P - 1}'s topk_idx names expert {E} \(token 2\)"):
        ep.dispatch(x, bad)
    dup = torch.zeros(m, 2, dtype=torch.int64)
    dup[:, 1] = 1
    if rank == 0:
        dup[3] = 1
    with pytest.raises(ValueError, match=r"rank 0's token 3 names expert 1 twice"):
        ep.dispatch(x, dup)
    drops = torch.tensor([[1, 2, 3, 4]]).repeat(m, 1)
    if rank == 0:  # two drops (-1) are no duplicate: expert 2 twice is the one to name
        drops[3] = torch.tensor([-1, 2, -1, 2])
    with pytest.raises(ValueError, match=r"rank 0's token 3 names expert 2 twice"):
        ep.dispatch(x, drops)
    with pytest.raises(TypeError, match=r"x is torch.float64, the group was built for"):
        ep.dispatch(x.double(), idx)
    with pytest.raises(ValueError, match=r"return_scales=True needs an FP8 wire_dtype"):
        ep.dispatch(x, idx, return_scales=True)
    # the group still works after the refusals
    recv_x, meta, handle = ep.dispatch(x, idx)
    out = ep.combine(recv_x, handle)
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match=r"y must be \("):
        ep.combine(recv_x[:-1], handle)
    return 1


def _checks(eps, pg, rank, P):
    """The routings on groups of one size: eps[dtype] is a group built for that dtype."""
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    n, case = 0, 100 * P
    dtypes = [bf16, f16, f32]
    modes = ["uniform", "skew", "drops", "uniform", "drops", "skew", "uniform", "drops"]
    for k in range(1, min(8, eps[f32].num_experts) + 1):
        case += 1
        T = 0 if (rank == 1 and k == 3) else 5 + (rank + k) % 4  # a rank with no tokens
        dt = dtypes[k % 3]
        n += _case(eps[dt], pg, case, rank, P, T, k, dt, modes[k - 1])
    n += _case(eps[f32], pg, case + 1, rank, P, 4, 2, f32, "all-dropped")
    n += _case(eps[bf16], pg, case + 2, rank, P, 6, 2, bf16, "drops", y_dtype=f32)
    n += _case(eps[f32], pg, case + 3, rank, P, 7, 2, f32, "skew", async_op=True)
    n += _case(eps[bf16], pg, case + 4, rank, P, 7, 3, bf16, "drops", wire=torch.float8_e4m3fn)
    n += _case(eps[f16], pg, case + 5, rank, P, 5, 1, f16, "uniform", wire=torch.float8_e5m2)
    n += _fp8_case(eps[bf16], pg, case + 6, rank, P)
    return n


# -- the device transport's routing on CPU (NOTE [moe device transport]) ------------------------
class _NoHostRead(torch.overrides.TorchFunctionMode):
    """While on, a torch call that reads a tensor's values on the host or whose output size
    depends on them (each a device-to-host sync on CUDA) raises: the CPU stand-in for
    set_sync_debug_mode("error"). ``allow`` is set by the test's host a2av only."""

    BAD = {
        "item", "tolist", "nonzero", "argwhere", "bincount", "unique", "unique_consecutive",
        "masked_select", "repeat_interleave", "__bool__", "__int__", "__float__", "__index__",
    }  # fmt: skip

    def __init__(self):
        super().__init__()
        self.allow, self.calls = False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.allow:
            self.calls += 1
            index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else ()
            index = index if isinstance(index, tuple) else (index,)
            masks = [i for i in index if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if name in self.BAD or masks:
                raise AssertionError(f"device transport: host read of data ({name})")
        return func(*args, **(kwargs or {}))


_GUARD = _NoHostRead()


def _host_a2av(pg):
    """Tests only: the device transport's a2av with the splits read on the host."""
    import torch.distributed as dist

    def a2av(out, inp, out_splits, in_splits):
        allow, _GUARD.allow = _GUARD.allow, True
        try:
            o, i = [int(v) for v in out_splits.tolist()], [int(v) for v in in_splits.tolist()]
            dist.all_to_all_single(out[: sum(o)], inp[: sum(i)], o, i, group=pg)
        finally:
            _GUARD.allow = allow

    return a2av


def _device_twin(ep, pg):
    """A group like ep whose transport is the device one over the host a2av."""
    from fastcomms._moe_device import DeviceTransport

    twin = object.__new__(type(ep))  # (copy.copy of a group is the group itself)
    twin.__dict__.update(ep.__dict__)
    twin._transport = DeviceTransport(ep.group, ep.rank, ep.size, ep.device, a2av=_host_a2av(pg))
    twin.transport = "device"
    return twin


def _device_same(ep, dev, case, rank, T, k, dtype, mode, wire=None, scales=False):
    """Dispatch, combine and the gradients of x and topk_weights: the same bits on both."""
    E, H = ep.num_experts, ep.hidden
    x, idx, w = _inputs(case, rank, T, k, E, H, dtype, mode)
    where = f"[rank {rank}] device case {case} ({mode}, k={k}, T={T}, {dtype}, wire={wire})"
    res = []
    for g in (ep, dev):
        grad = not scales
        xg, wg = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        with _GUARD if g is dev else contextlib.nullcontext():  # no host read on the device path
            recv_x, meta, handle = g.dispatch(xg, idx, wg, wire_dtype=wire, return_scales=scales)
            if scales:
                res.append((recv_x, meta, None, None, None))
                continue
            y = recv_x * (1 + meta.weights).unsqueeze(1).to(dtype)
            out = g.combine(y, handle)
            (out.float() * torch.arange(H)).sum().backward()
        res.append((recv_x, meta, out, xg.grad, wg.grad))
    (ra, ma, oa, gxa, gwa), (rb, mb, ob, gxb, gwb) = res
    assert _same(ra, rb), where
    for f in ("counts", "offsets", "weights", "src", "scales"):
        a, b = getattr(ma, f), getattr(mb, f)
        assert (a is None and b is None) or _same(a, b), (where, f)
    for a, b, name in ((oa, ob, "combine"), (gxa, gxb, "x.grad"), (gwa, gwb, "w.grad")):
        assert (a is None and b is None) or _same(a, b), (where, name)
    return 1


def _device_checks(eps, pg, rank, P):
    """The device transport's routing math bit-identical with the collective transport."""
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    devs = {dt: _device_twin(ep, pg) for dt, ep in eps.items()}
    assert all(
        ep.transport == "collective" and devs[dt].transport == "device" for dt, ep in eps.items()
    )
    n, case = 0, 500 * P
    modes = ["skew", "drops", "uniform", "drops", "skew", "uniform", "drops", "skew"]
    dtypes = [f16, f32, bf16]
    for k in range(1, min(8, eps[f32].num_experts) + 1):
        case += 1
        T = 0 if (rank == 0 and k == 2) else 3 + (rank + k) % 6  # a rank with no tokens
        dt = dtypes[k % 3]
        n += _device_same(eps[dt], devs[dt], case, rank, T, k, dt, modes[k - 1])
    n += _device_same(eps[f32], devs[f32], case + 1, rank, 4, 2, f32, "all-dropped")
    n += _device_same(
        eps[bf16], devs[bf16], case + 2, rank, 8, 3, bf16, "drops", wire=torch.float8_e4m3fn
    )
    n += _device_same(
        eps[f16], devs[f16], case + 3, rank, 5, 2, f16, "skew", wire=torch.float8_e5m2
    )
    n += _device_same(
        eps[bf16],
        devs[bf16],
        case + 4,
        rank,
        6,
        2,
        bf16,
        "drops",
        wire=torch.float8_e4m3fn,
        scales=True,
    )
    assert _GUARD.calls > 100 * n, _GUARD.calls  # the guard saw the device path's torch calls
    # armed control: the guard sees a host read (and a boolean-mask index)
    for bad_read in (lambda t: t.tolist(), lambda t: t[t > 0], lambda t: t.nonzero()):
        with pytest.raises(AssertionError, match="host read of data"), _GUARD:
            bad_read(torch.ones(3))
    # refusals: every rank gets an empty dispatch and check_errors raises the same on each
    ep, dev = eps[f32], devs[f32]
    E, H, m = ep.num_experts, ep.hidden, ep.max_tokens_per_rank
    x = torch.randn(m, H)
    idx = torch.zeros(m, 2, dtype=torch.int64)
    idx[:, 1] = 1
    bad = idx.clone()
    if rank == P - 1:
        bad[2, 1] = E
    dup = idx.clone()
    if rank == 0:
        dup[3] = 1
    drops = torch.tensor([[1, 2, 3, 4]]).repeat(m, 1)
    if rank == 0:  # two drops (-1) are no duplicate: expert 2 twice is the one to name
        drops[3] = torch.tensor([-1, 2, -1, 2])
    big = torch.zeros(m + 3, H)
    over = (big, torch.zeros(m + 3, 2, dtype=torch.int64) + idx[:1]) if rank == 1 else (x, idx)
    for args, msg in (
        ((x, bad), rf"rank {P - 1}'s topk_idx names expert {E} \(token 2\)"),
        ((x, dup), r"rank 0's token 3 names expert 1 twice"),
        ((x, drops), r"rank 0's token 3 names expert 2 twice"),
        (over, rf"rank 1 dispatches {m + 3} tokens, more than max_tokens_per_rank={m}"),
    ):
        recv_x, meta, handle = dev.dispatch(*args)
        assert int(meta.counts.sum()) == 0 and not recv_x.any()
        assert not dev.combine(recv_x, handle).any()
        with pytest.raises(ValueError, match=msg + ".*that dispatch sent nothing"):
            dev.check_errors()
        dev.check_errors()  # cleared
    n += _device_same(ep, dev, case + 5, rank, 5, 2, f32, "uniform")  # usable after
    return n


def moe_world(comm, rank, size):
    """Run by conftest's world fixture: comm is a gloo communicator over the world, beside
    torch.distributed's gloo default group."""
    import torch.distributed as dist
    from fastcomms.moe import ExpertParallelGroup
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)  # four ranks on a CI machine's two cores: no OpenMP spinning
    checks = 0
    for P in (2, 3, 4):
        members = list(range(P))
        sub = comm.split(members if rank < P else [], f"moe{P}")
        pg = dist.new_group(members) if P < size else dist.group.WORLD
        if rank < P:
            E = 8 if P != 3 else 9
            with ExpertParallelGroup(sub, E, 16, max_tokens_per_rank=8, dtype=torch.bfloat16) as ep:
                assert ep.transport == "collective" and (ep.rank, ep.size) == (rank, P)
                assert ep.transport_reason.startswith("cpu tensors over a fastcomms gloo group")
                # groups over the communicator and over the ProcessGroup, one per dtype
                eps = {torch.bfloat16: ep}
                for dt, g in ((torch.float16, pg), (torch.float32, sub), (torch.float64, pg)):
                    eps[dt] = ExpertParallelGroup(g, E, 16, max_tokens_per_rank=8, dtype=dt)
                checks += _checks(eps, pg, rank, P)
                checks += _refusals(eps[torch.float32], rank, P)
                checks += _device_checks(eps, pg, rank, P)
                checks += _grad_case(eps[torch.float64], 7 + P, rank, P, lambda r: 4 + r % 2 * 3)
            assert ep.transport == "destroyed"
            with pytest.raises(ValueError, match="the group was destroyed"):
                ep.dispatch(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(1, 1).long())
            checks += _grad_case(eps[torch.float64], 70 + P, rank, P, lambda r: 0 if r == 1 else 5)
            # a backward after destroy() says so (on every rank: it sends nothing)
            x = torch.randn(4, 16, requires_grad=True)
            recv_x, meta, handle = eps[torch.float32].dispatch(x, torch.zeros(4, 1).long())
            out = eps[torch.float32].combine(recv_x, handle)
            for g in eps.values():
                g.destroy()
            with pytest.raises(ValueError, match="backward of combine.*the group was destroyed"):
                out.sum().backward()
            if P < size:
                sub.finalize()
        dist.barrier()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    ep = ExpertParallelGroup(mesh, 8, 16, max_tokens_per_rank=8, dtype=torch.float32)
    checks += _case(ep, dist.group.WORLD, 900, rank, size, 6, 2, torch.float32, "uniform")
    ep = ExpertParallelGroup(None, 4, 16, max_tokens_per_rank=8, dtype=torch.float32)
    checks += _case(ep, dist.group.WORLD, 901, rank, size, 6, 2, torch.float32, "drops")
    # the sizes must agree
    with pytest.raises(ValueError, match=r"rank [03] was built with num_experts=8, hidden=1[67]"):
        ExpertParallelGroup(
            comm, 8, 17 if rank == 3 else 16, max_tokens_per_rank=8, dtype=torch.float32
        )
    # the example trains and matches its one-process losses
    losses, ref = _example().train(comm, steps=3, experts=8, topk=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    losses2, ref2 = _example().train(comm, steps=2, experts=4, topk=3, async_dispatch=True)
    torch.testing.assert_close(torch.tensor(losses2), torch.tensor(ref2), rtol=1e-5, atol=1e-6)
    print(f"[rank {rank}/{size}] moe: {checks} cases bit-exact; example losses {losses}")


def test_moe_world(world):
    world(moe_world, 4)


# -- the row kernels' host side (NOTE [moe row kernels]) ------------------------------------------
def test_gather_rows_cpu_semantics():
    """The CPU twin of the row gather: rows below the count copied, index -1 a zero row, rows from
    the count on zero; the kernel's binding refuses CPU tensors, naming the argument."""
    import fastcomms._C as C
    from fastcomms._moe_device import _gather

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    src = torch.randint(0, 256, (7, 12), dtype=torch.uint8, generator=g)
    index = torch.tensor([3, -1, 0, 6, 2, 5], dtype=torch.int64)
    for count in (None, 0, 4, 6, 9):
        dst = torch.full((6, 12), 0xA5, dtype=torch.uint8)
        c = None if count is None else torch.tensor([count])
        _gather(dst, src, index, c)
        n = 6 if count is None else min(count, 6)
        for i in range(6):
            want = src[index[i]] if i < n and index[i] >= 0 else torch.zeros(12, dtype=torch.uint8)
            assert torch.equal(dst[i], want), (count, i)
    with pytest.raises(ValueError, match="dst must be a CUDA tensor"):
        C._moe_gather_rows(torch.empty(6, 12, dtype=torch.uint8), src, index, None, True)
    with pytest.raises(ValueError, match="out must be a CUDA tensor"):
        C._moe_weighted_sum(torch.empty(2, 4), torch.empty(6, 4), None, torch.empty(2, 3))
    with pytest.raises(ValueError, match="moe gather_dequant: out must be a CUDA tensor"):
        fp8 = src.view(torch.float8_e4m3fn)
        C._moe_gather_dequant(torch.empty(6, 12), fp8, torch.ones(6), index, None)
