# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""PREMUL_SUM with a number or a tensor factor on every float dtype, AVG on integers, and a
batch's send/recv pair to self, over gloo at worlds of 2 and 3, bit-exact against the arithmetic
the backend documents (NOTE [premul arithmetic], NOTE [self pairs in a batch])."""

import datetime

import pytest
import torch
from fastcomms import ReduceOp

WORLDS = [2, 3]
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _x(rank, dtype, n=33):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _premul_ref(size, dtype, factor):
    # NCCL's order: the factor in the dtype, each product rounded to the dtype, then the sum in
    # rank order (gloo's ring sums in another order; exact here: see the values chosen below)
    f = torch.tensor(factor, dtype=torch.float64).to(dtype)
    terms = [(_x(q, dtype) * f).to(dtype) for q in range(size)]
    return terms


def premul_and_avg(comm, rank, size):
    # factors that round in half types (1/3) and ones that do not (0.5)
    for dtype in FLOATS:
        for factor in (0.5, 1.0 / 3.0):
            for as_tensor in (False, True):
                f = torch.tensor(factor, dtype=torch.float64) if as_tensor else factor
                x = _x(rank, dtype)
                comm.all_reduce(x, ReduceOp.PREMUL_SUM(f), False)
                # each rank's term rounded as the backend rounds it, summed by gloo's own sum
                # (SUM over the pre-scaled terms: the same reduction, the same order)
                ref = _premul_ref(size, dtype, factor)[rank].clone()
                comm.all_reduce(ref, ReduceOp.SUM, False)
                assert torch.equal(x, ref), (dtype, factor, as_tensor)
                # the check can tell: 1/3 rounded to float16 first gives other terms than the
                # float factor would
                if dtype == torch.float16 and factor != 0.5:
                    term = _premul_ref(size, dtype, factor)[rank]
                    assert not torch.equal(term, (_x(rank, dtype).double() * factor).to(dtype))
    # a tensor factor is read when the op runs, not when the op is made
    f = torch.tensor(2.0)
    op = ReduceOp.PREMUL_SUM(f)
    f.fill_(3.0)
    x = torch.full((4,), float(rank + 1))
    comm.all_reduce(x, op, False)
    assert torch.equal(x, torch.full((4,), 3.0 * sum(q + 1 for q in range(size))))
    # reduce_scatter_single and reduce take it too
    out = torch.empty(2, dtype=torch.bfloat16)
    comm.reduce_scatter_single(
        out,
        torch.ones(2 * size, dtype=torch.bfloat16),
        ReduceOp.PREMUL_SUM(torch.tensor(0.25)),
        False,
    )
    assert torch.equal(out, torch.full((2,), 0.25 * size, dtype=torch.bfloat16))
    x = torch.ones(3, dtype=torch.float16)
    comm.reduce(x, 0, ReduceOp.PREMUL_SUM(torch.tensor(0.5, dtype=torch.float64)), False)
    if rank == 0:
        assert torch.equal(x, torch.full((3,), 0.5 * size, dtype=torch.float16))
    # refusals (torchcomms refuses these too: integer tensors; we also refuse what NCCL would
    # misread: a factor of several elements, an integer factor)
    with pytest.raises(TypeError, match="PREMUL_SUM needs a floating-point tensor, got int32"):
        comm.all_reduce(torch.ones(2, dtype=torch.int32), ReduceOp.PREMUL_SUM(2.0), False)
    with pytest.raises(ValueError, match="factor tensor must hold one element"):
        comm.all_reduce(torch.ones(2), ReduceOp.PREMUL_SUM(torch.ones(2)), False)
    with pytest.raises(TypeError, match="factor tensor has dtype int64, expected float32"):
        comm.all_reduce(torch.ones(2), ReduceOp.PREMUL_SUM(torch.tensor(2)), False)
    # AVG on integers: the sum divided by the world size, truncated toward zero (torchcomms)
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        lo = 0 if dtype == torch.uint8 else -20
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randint(lo, 20, (17,), generator=g).to(dtype)
        total = torch.zeros(17, dtype=torch.int64)
        for q in range(size):
            gq = torch.Generator().manual_seed(7 + q)
            total += torch.randint(lo, 20, (17,), generator=gq)
        comm.all_reduce(x, ReduceOp.AVG, False)
        assert torch.equal(x, torch.div(total, size, rounding_mode="trunc").to(dtype)), dtype
    with pytest.raises(TypeError, match="AVG is not defined on bool tensors"):
        comm.all_reduce(torch.ones(2, dtype=torch.bool), ReduceOp.AVG, False)


def self_pairs(comm, rank, size):
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    src = torch.randn(13, dtype=torch.float64)
    got = torch.full((13,), float("nan"), dtype=torch.float64)  # poisoned
    ring_out = torch.arange(5, dtype=torch.float32) + rank
    ring_in = torch.full((5,), -1.0)
    b = comm.batch_op_create()
    b.send(src, rank)
    b.send(ring_out, nxt)
    b.recv(ring_in, prv)
    b.recv(got, rank)
    b.issue(False)
    assert torch.equal(got, src)
    assert torch.equal(ring_in, torch.arange(5, dtype=torch.float32) + prv)
    # a lone send or recv to self fails, as in NCCL
    b = comm.batch_op_create()
    b.send(src, rank)
    with pytest.raises(ValueError, match="send to self without a matching recv"):
        b.issue(False)
    b = comm.batch_op_create()
    b.recv(got, rank)
    with pytest.raises(ValueError, match="recv from self without a matching send"):
        b.issue(False)
    # sizes or dtypes that differ: named both
    b = comm.batch_op_create()
    b.send(src, rank)
    b.recv(torch.empty(12, dtype=torch.float64), rank)
    with pytest.raises(ValueError, match=r"float64\[13\].*float64\[12\]"):
        b.issue(False)
    b = comm.batch_op_create()
    b.send(src, rank)
    b.recv(torch.empty(13, dtype=torch.float32), rank)
    with pytest.raises(ValueError, match=r"float64\[13\].*float32\[13\]"):
        b.issue(False)
    # a plain send to self stays refused
    with pytest.raises(ValueError, match="dst"):
        comm.send(src, rank, False)
    # async: the copy is done once the work is
    got2 = torch.zeros(13, dtype=torch.float64)
    b = comm.batch_op_create()
    b.recv(got2, rank)
    b.send(src, rank)
    b.issue(True).wait()
    assert torch.equal(got2, src)
    comm.barrier(False, timeout=datetime.timedelta(seconds=30))


@pytest.mark.parametrize("size", WORLDS)
def test_premul_sum_and_integer_avg(world, size):
    world(premul_and_avg, size)


@pytest.mark.parametrize("size", WORLDS)
def test_batch_pair_to_self_is_a_copy(world, size):
    world(self_pairs, size)
