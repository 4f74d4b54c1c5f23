# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The hierarchical Ulysses all-to-all on CPU (issue 37, item 1; NOTE [hierarchical split]): ranks
split into "hosts" by FASTCOMMS_HOST_ID (tests only), the host's ranks over a split of the gloo
communicator, the other hosts' over the communicator itself. Bit-exact against the flat
collective path of the same communicator for both modes, even and uneven splits, four dtypes,
kv_replicas, out=, async and autograd; host maps contiguous and interleaved; the choice and its
errors; and an armed control (the exchange between hosts left out) whose poisoned output must
differ every run. The multi-host test (test_multihost.py) runs it across network namespaces."""

import os

import pytest
import torch

# Each case: the host of every rank.
HOST_MAPS = [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1]]


def _seed(comm):
    s = (
        torch.randint(0, 2**31 - 1, (1,))
        if comm.get_rank() == 0
        else torch.zeros(1, dtype=torch.long)
    )
    comm.broadcast(s, 0, False)
    return int(s.item())


def _splits(gen, world, total_min):
    parts = [int(v) for v in torch.randint(0, 3, (world,), generator=gen)]
    parts[int(torch.randint(0, world, (1,), generator=gen))] += total_min
    return parts


def _bit_exact(comm, rank, world):
    from fastcomms.ulysses import UlyssesGroup

    for host_of in [m for m in HOST_MAPS if len(m) == world]:
        os.environ["FASTCOMMS_HOST_ID"] = f"h{host_of[rank]}"
        g = UlyssesGroup(comm, transport="hierarchical")
        flat = UlyssesGroup(comm, transport="collective")
        assert g.transport == "hierarchical", g.transport_reason
        assert f"span {len(set(host_of))} hosts" in g.transport_reason, g.transport_reason
        seed = _seed(comm)
        gen = torch.Generator().manual_seed(seed)
        checks = 0
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
            for uneven in (False, True):
                b, d = (
                    int(torch.randint(1, 3, (1,), generator=gen)),
                    2 * int(torch.randint(1, 5, (1,), generator=gen)),
                )
                if uneven:
                    seq, heads = _splits(gen, world, 1), _splits(gen, world, 1)
                else:
                    s_r, h_r = (int(v) for v in torch.randint(1, 4, (2,), generator=gen))
                    seq, heads = [s_r] * world, [h_r] * world
                what = f"seed {seed} hosts {host_of} {dtype} seq {seq} heads {heads} b {b} d {d}"
                mine = torch.Generator().manual_seed(seed * 31 + rank)
                x = torch.randn(b, seq[rank], sum(heads), d, generator=mine).to(dtype)
                kw = {"seq_splits": seq, "head_splits": heads} if uneven else {}
                want = flat.all_to_all_4d(x, **kw)
                got = g.all_to_all_4d(x, **kw)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
                back = g.all_to_all_4d(got, mode=1, **kw)
                assert torch.equal(back.view(torch.uint8), x.view(torch.uint8)), what + " mode 1"
                out = torch.full_like(want, 7)  # poison: an unwritten byte shows
                g.all_to_all_4d(x, out=out, **kw)
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), what + " out="
                w = g.all_to_all_4d_async(x, **kw)
                assert torch.equal(w.wait().view(torch.uint8), want.view(torch.uint8)), what
                checks += 4
        # kv_replicas: one KV head per pair of ranks (GQA), both modes; and autograd through it
        kv = 2 if world % 2 == 0 else world
        x = torch.randn(2, 3, world // kv, 8, generator=torch.Generator().manual_seed(seed + rank))
        want = flat.all_to_all_4d(x, kv_replicas=kv)
        assert torch.equal(g.all_to_all_4d(x, kv_replicas=kv), want), f"seed {seed} kv {kv}"
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        wgt = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 7))
        (g.all_to_all_4d(xa, kv_replicas=kv) * wgt).sum().backward()
        (flat.all_to_all_4d(xb, kv_replicas=kv) * wgt).sum().backward()
        assert torch.equal(xa.grad, xb.grad), f"seed {seed} kv {kv} backward"
        checks += 2
        g.destroy()
        flat.destroy()
        print(f"[rank {rank}] hosts {host_of}: {checks} checks bit-exact (seed {seed})")
    # one spawned world per size (CI time): the armed control at 4, the choice's errors at 3
    (_armed_control if world == 4 else _choice)(comm, rank, world)


@pytest.mark.parametrize("size", [3, 4])
def test_hierarchical_is_bit_exact_with_an_armed_control_and_the_choice(world, size):
    """World 4: host maps [0,0,1,1] and [0,1,0,1], then the armed control; world 3: [0,0,1],
    then the choice and its errors."""
    world(_bit_exact, size)


def _armed_control(comm, rank, world):
    """The exchange between hosts left out (fault skip_remote): the blocks from the other host
    stay poison, so the comparison that the real test makes must fail, every run."""
    from fastcomms.ulysses import UlyssesGroup

    os.environ["FASTCOMMS_HOST_ID"] = f"h{rank // 2}"
    g = UlyssesGroup(comm, transport="hierarchical")
    flat = UlyssesGroup(comm, transport="collective")
    x = torch.randn(1, 4, 2 * world, 8, generator=torch.Generator().manual_seed(_seed(comm) + rank))
    want = flat.all_to_all_4d(x)
    g._tune("fault", "skip_remote")
    out = torch.full_like(want, float("nan"))
    g.all_to_all_4d(x, out=out)
    assert not torch.equal(out, want), "the control's output matched: the test could not fail"
    mine = [q for q in range(world) if q // 2 == rank // 2]
    for q in range(world):  # the local blocks came, the remote ones did not
        block = out[:, 4 * q : 4 * q + 4]
        assert torch.equal(block, want[:, 4 * q : 4 * q + 4]) if q in mine else block.isnan().all()
    g._tune("fault", "none")
    g.all_to_all_4d(x, out=out)
    assert torch.equal(out, want)
    g.destroy()
    flat.destroy()


def _choice(comm, rank, world):
    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    os.environ["FASTCOMMS_HOST_ID"] = "same"
    with pytest.raises(
        fastcomms.UnsupportedError,
        match="hierarchical transport is not available: the 3 ranks are on one host",
    ):
        UlyssesGroup(comm, transport="hierarchical")
    os.environ["FASTCOMMS_HOST_ID"] = f"h{rank}"
    with pytest.raises(
        fastcomms.UnsupportedError, match="one rank on each: nothing moves inside a host"
    ):
        UlyssesGroup(comm, transport="hierarchical")
    g = UlyssesGroup(comm)  # auto on CPU: the flat path, saying why
    assert g.transport == "collective" and "not a CUDA device" in g.transport_reason
    g.destroy()
    with pytest.raises(
        ValueError, match="transport must be auto, nvlink, hierarchical or collective"
    ):
        UlyssesGroup(comm, transport="ring")
    with pytest.raises(
        ValueError, match="require_nvlink=True contradicts transport='hierarchical'"
    ):
        UlyssesGroup(comm, transport="hierarchical", require_nvlink=True)
