# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms.ring and fastcomms.sequence_parallel on CPU over gloo (issue 37, items 2 and 3).

One spawned world of 4 checks many things, to keep the file quick: RingGroup on rings of 2, 3
and 4 ranks over a fastcomms communicator and a torch.distributed ProcessGroup, and over a 1-D
DeviceMesh,
bit-exact against torch.distributed isend/irecv (several dtypes, one tensor, lists and tuples,
forward and reverse); the double buffer (step k+2 reuses step k's memory, the last two results
intact; a third exchange in flight refused); and at world 4 = 2 x 2 the SequenceParallelGroup
(from a (ring, ulysses) pair over torch's default group and over a communicator, from a 2-D
DeviceMesh; its errors) and the USP example's attention against single-process attention
(output and q/k/v gradients, grouped-query, causal zig-zag), with armed controls that the same
checks must catch."""

import copy
import importlib.util
import os

import pytest
import torch
from fastcomms.ring import zigzag_indices, zigzag_shard, zigzag_unshard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location(
        "usp_attention", os.path.join(ROOT, "examples", "usp_attention.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_zigzag_round_trip():
    for world in (1, 2, 3, 4):
        x = torch.arange(2 * world * 3 * 5).view(1, 2 * world * 3, 5)
        parts = [zigzag_shard(x, world, r, dim=1) for r in range(world)]
        assert torch.equal(zigzag_unshard(parts, dim=1), x)
        for r, p in enumerate(parts):
            # the positions helper names the same tokens the shard holds
            assert torch.equal(p[0, :, 0] // 5, zigzag_indices(x.shape[1], world, r))
            # rank r holds chunks r and 2W-1-r: an early and a late one
            c = x.shape[1] // (2 * world)
            assert p[0, 0, 0].item() == r * c * 5
            assert p[0, c, 0].item() == (2 * world - 1 - r) * c * 5
    # armed control: unsharding in plain rank order (no zig-zag) does not give x back
    parts = [zigzag_shard(x, 4, r, dim=1) for r in range(4)]
    assert not torch.equal(torch.cat(parts, dim=1), x)
    with pytest.raises(ValueError, match=r"must divide into 2 \* world = 8 equal chunks"):
        zigzag_shard(torch.zeros(1, 12, 2), 4, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        zigzag_shard(torch.zeros(1, 8, 2), 2, 2)


# -- the spawned job ------------------------------------------------------------------------------
def _data(step, rank, i, shape, dtype):
    """What rank `rank` sends as tensor i at step `step`: every rank can compute every rank's."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + i)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


SHAPES = [
    ((3, 5), torch.float32),
    ((2, 4, 6), torch.bfloat16),
    ((7,), torch.int32),
    ((2, 3), torch.float64),
    ((4, 4), torch.uint8),
]


def _same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _torch_reference(tensors, rank, size, reverse, pg):
    """torch.distributed isend/irecv on a gloo group of the first `size` ranks (group ranks are
    global ranks): the same exchange."""
    import torch.distributed as dist

    dst = (rank - 1) % size if reverse else (rank + 1) % size
    src = (rank + 1) % size if reverse else (rank - 1) % size
    out = [torch.empty_like(t) for t in tensors]
    reqs = [dist.isend(t, dst, group=pg) for t in tensors]
    reqs += [dist.irecv(o, src, group=pg) for o in out]
    for q in reqs:
        q.wait()
    return out


def _ring_checks(ring, rank, size, label, pg):
    """Bit-exact against torch.distributed and against the known data; double buffer; reverse."""
    from fastcomms.ring import RingGroup

    assert isinstance(ring, RingGroup) and ring.transport == "collective", ring.transport
    assert (ring.rank, ring.size) == (rank, size)
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    assert (ring.prev_rank, ring.next_rank) == (prev, nxt)
    step = 0
    checks = 0
    for reverse in (False, True, False):
        src = nxt if reverse else prev
        for form in (list, tuple, "single"):
            shapes = SHAPES[:1] if form == "single" else SHAPES
            mine = [_data(step, rank, i, s, d) for i, (s, d) in enumerate(shapes)]
            sent = mine[0] if form == "single" else form(mine)
            got = ring.exchange(sent, reverse=reverse).wait()
            if form == "single":
                assert isinstance(got, torch.Tensor)
                got = [got]
            else:
                assert type(got) is form, (type(got), form)
            ref = _torch_reference(mine, rank, size, reverse, pg)
            for i, (s, d) in enumerate(shapes):
                assert _same(got[i], ref[i]), f"{label} step {step} tensor {i} vs torch"
                assert _same(got[i], _data(step, src, i, s, d)), f"{label} step {step} tensor {i}"
                checks += 2
            if size > 2:  # armed control: the other direction's data is not what arrived
                other = (rank + 1) % size if not reverse else (rank - 1) % size
                assert not _same(got[0], _data(step, other, 0, *shapes[0]))
            step += 1
    # NOTE [ring double buffer]: three steps in flight order; step k+2 reuses step k's buffers
    works, sent = [], []
    for k in range(3):
        mine = [_data(100 + k, rank, i, s, d) for i, (s, d) in enumerate(SHAPES)]
        sent.append(mine)
        works.append(ring.exchange(mine))
        if k == 1:
            # a third exchange while step k's is unwaited is refused (its buffers are reused)
            with pytest.raises(RuntimeError, match="never waited on"):
                ring.exchange(mine)
            res0 = works[0].wait()
            res1 = works[1].wait()
            for i, (s, d) in enumerate(SHAPES):
                assert _same(res0[i], _data(100, prev, i, s, d))
    res2 = works[2].wait()
    for i, (s, d) in enumerate(SHAPES):
        assert res2[i].data_ptr() == res0[i].data_ptr(), "step k+2 did not reuse step k's buffer"
        assert res1[i].data_ptr() != res2[i].data_ptr()
        assert _same(res1[i], _data(101, prev, i, s, d)), "step k+1's result was overwritten"
        assert _same(res2[i], _data(102, prev, i, s, d))
        # armed control: the reuse is real, step k's tensors now read step k+2's data
        assert _same(res0[i], _data(102, prev, i, s, d))
        checks += 3
    assert works[0].wait() is not None and works[0].is_completed()
    return checks


def _sp_checks(comm, rank, size):
    import torch.distributed as dist
    from fastcomms.ring import RingGroup
    from fastcomms.sequence_parallel import SequenceParallelGroup
    from torch.distributed.device_mesh import init_device_mesh

    ex = _example()
    # from a (ring, ulysses) pair over torch's default group: a 2-D DeviceMesh of gloo groups
    sp = SequenceParallelGroup((2, 2))
    assert (sp.ring_size, sp.ulysses_size, sp.size, sp.rank) == (2, 2, 4, rank)
    assert (sp.ring_rank, sp.ulysses_rank) == divmod(rank, 2)
    assert sp.mesh.mesh_dim_names == ("ring", "ulysses") and sp.mesh.mesh.tolist() == [
        [0, 1],
        [2, 3],
    ]
    assert isinstance(sp.ring, RingGroup) and sp.ring.size == 2
    # the grid: the Ulysses group is the row (consecutive ranks), the ring the column
    row = torch.tensor([rank])
    got = sp.ring.exchange(row).wait()
    assert got.item() == (rank + 2) % 4, got
    dist.barrier()
    # the head limit, explained
    assert sp.check_heads(8) == 1 and sp.check_heads(8, 2) == 1 and sp.check_heads(8, 1) == 2
    with pytest.raises(
        ValueError,
        match=r"5 query heads do not split over the Ulysses size 2 "
        r"\(ring 2 x ulysses 2 = 4 ranks\).*ring 4 x ulysses 1 fits",
    ):
        sp.check_heads(5)
    with pytest.raises(ValueError, match=r"3 K/V heads \(grouped-query attention\) do not split"):
        sp.check_heads(6, 3)
    with pytest.raises(ValueError, match="positive multiple of the K/V heads"):
        sp.check_heads(8, 3)
    # mesh errors
    with pytest.raises(ValueError, match="ring 3 x ulysses 2 = 6 ranks, the group has 4"):
        SequenceParallelGroup((3, 2))
    with pytest.raises(ValueError, match="must differ"):
        SequenceParallelGroup((2, 2), ring_dim="x", ulysses_dim="x")
    with pytest.raises(ValueError, match=r"ulysses_dim='sp' is not a dimension of the mesh"):
        SequenceParallelGroup(sp.mesh, ulysses_dim="sp")
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("ring",))
    with pytest.raises(ValueError, match="must be 2-D"):
        SequenceParallelGroup(flat)
    with pytest.raises(TypeError, match="2-D DeviceMesh or a"):
        SequenceParallelGroup("2x2")
    # from a 2-D DeviceMesh with its dimensions the other way round
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("u", "r"))
    sp_mesh = SequenceParallelGroup(swapped, ring_dim="r", ulysses_dim="u")
    assert sp_mesh.ring.size == 2 and sp_mesh.ulysses._size == 2
    # from a pair over a fastcomms communicator (split into the two dimensions)
    sp_comm = SequenceParallelGroup((2, 2), group=comm)
    assert (sp_comm.ring_rank, sp_comm.ulysses_rank) == divmod(rank, 2)
    assert sp_comm.ring.group.get_backend() == "gloo" and sp_comm.ulysses.transport == "collective"
    # the USP example's attention against single-process attention (output, q/k/v gradients;
    # multi-head, grouped-query with K/V heads split and replicated; causal zig-zag)
    rows = ex.run_checks(sp, log=lambda *a: None)
    assert len(rows) == 6, rows
    # the same over the communicator's grid, and the plain-torch blocks in float32: one causal
    # grouped-query case each
    gqa = dict(batch=1, seq=32, heads=8, kv_heads=1, dim=16, causal=True, device="cpu")
    assert max(ex.check_case(sp_comm, dtype=torch.float64, impl="auto", **gqa)) < 1e-9
    assert max(ex.check_case(sp, dtype=torch.float32, impl="math", **gqa)) < 2e-4
    # armed control 1: causal attention on contiguous (not zig-zag) shards must be caught
    q, k, v = (
        torch.randn(1, 32, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        for s in (1, 2, 3)
    )
    want = sp.shard(ex.reference_attention(q, k, v, causal=True))
    wrong = ex.usp_attention(*(sp.shard(t) for t in (q, k, v)), sp, causal=True)
    right = ex.usp_attention(*(sp.shard(t, zigzag=True) for t in (q, k, v)), sp, causal=True)
    assert torch.allclose(
        right, sp.shard(ex.reference_attention(q, k, v, causal=True), zigzag=True)
    )
    miss = (wrong - want).abs().max().reshape(1)
    dist.all_reduce(miss, op=dist.ReduceOp.MAX)  # ring rank 0's first half happens to be right
    assert miss.item() > 1e-3, "armed control (layout) was not caught"
    # armed controls 2 and 3, each one case (causal, grouped-query) that the check must miss:
    # the merge without its log-sum-exp weights, and a backward whose gradient accumulators stop
    # one hop short of home
    case = dict(
        batch=1,
        seq=32,
        heads=8,
        kv_heads=2,
        dim=16,
        causal=True,
        dtype=torch.float64,
        device="cpu",
        impl="auto",
    )
    saved_merge, saved_bwd = ex._merge, ex.RingAttention.backward

    def plain_sum(out, lse, o_b, lse_b):
        out.add_(o_b.to(out.dtype))
        lse.copy_(torch.logaddexp(lse, lse_b.to(lse.dtype)))

    def short_backward(ctx, dout):
        dq, dk, dv, *rest = saved_bwd(ctx, dout)
        back = ctx.sp.ring_grad.exchange([dk, dv], reverse=True).wait()
        return (dq, back[0].clone(), back[1].clone(), *rest)

    def worst(errs):  # over every rank: ring rank 0's causal rows see only the diagonal block
        t = torch.tensor(errs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    assert max(worst(ex.check_case(sp, **case))) < 1e-9  # unarmed: the same case passes
    try:
        ex._merge = plain_sum
        out_err, _ = worst(ex.check_case(sp, **case))
        ex._merge = saved_merge
        ex.RingAttention.backward = staticmethod(short_backward)
        out_ok, grad_err = worst(ex.check_case(sp, **case))
    finally:
        ex._merge, ex.RingAttention.backward = saved_merge, staticmethod(saved_bwd)
    assert out_err > 1e-3, f"armed control (merge) was not caught: {out_err}"
    assert out_ok < 1e-9 and grad_err > 1e-3, f"armed control (backward) not caught: {grad_err}"
    model = torch.nn.Module()  # groups are handles: a deep copy of a model holding them shares
    model.sp, model.ring = sp, sp.ring
    dup = copy.deepcopy(model)
    assert dup.sp is sp and dup.ring is sp.ring and copy.copy(sp.ulysses) is sp.ulysses
    with sp_comm, sp:  # leaving the block destroys both, their Ulysses and ring groups
        pass
    assert sp.ulysses.transport == sp_comm.ring.transport == "destroyed"
    return len(rows)


def ring_and_sequence_parallel(comm, rank, size):
    """Run by conftest's world fixture: comm is a gloo communicator over the world, beside
    torch.distributed's gloo default group."""
    import torch.distributed as dist
    from fastcomms.ring import RingGroup
    from torch.distributed.device_mesh import DeviceMesh

    # rings of 2, 3 and 4 ranks (the first k ranks: group rank = global rank), each over a
    # fastcomms communicator and a torch.distributed group, and the whole world over a 1-D
    # DeviceMesh; one spawned world keeps the file quick
    checks = 0
    for k in range(2, size + 1):
        members = list(range(k))
        sub = comm.split(members if rank < k else [], f"ring{k}")
        pg = dist.new_group(members) if k < size else dist.group.WORLD
        if rank < k:
            with RingGroup(sub) as ring:  # a with block destroys the group as it ends
                checks += _ring_checks(ring, rank, k, f"comm of {k}", pg)
            assert ring.transport == "destroyed", ring.transport
            checks += _ring_checks(RingGroup(pg), rank, k, f"group of {k}", pg)
            if k < size:
                sub.finalize()
        dist.barrier()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    checks += _ring_checks(RingGroup(mesh), rank, size, "1-D mesh", dist.group.WORLD)
    rows = _sp_checks(comm, rank, size)
    print(f"[rank {rank}/{size}] ring: {checks} checks bit-exact; usp: {rows} cases")


def test_ring_and_sequence_parallel(world):
    world(ring_and_sequence_parallel, 4)
