# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' wait operators and async tensor (NOTE [torchcomms wait ops],
fastcomms/functional/async_tensor.py): ``torch.ops.torchcomms.torchcomm_wait_tensors`` and
``torchcomm_wait_tensors_`` exist after ``import fastcomms``, are the identity to autograd (eager
and under torch.compile(fullgraph=True), no recompilation), and wait for the asynchronous call
pending on their tensors; ``TorchCommsAsyncTensor`` waits once, on first use, and is its
tensor to autograd. Written from torchcomms' documented behaviour; gloo, 2 and 3 processes for
the waits."""

import os
import time

import fastcomms  # noqa: F401  (defines the operators)
import pytest
import torch
import torch._dynamo
from fastcomms import ReduceOp
from fastcomms.functional.async_tensor import TorchCommsAsyncTensor
from torch._dynamo.utils import counters


def _ops():
    return torch.ops.torchcomms.torchcomm_wait_tensors, torch.ops.torchcomms.torchcomm_wait_tensors_


def _rand(g):
    shape = tuple(
        int(v)
        for v in torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
    )
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _identity_cases(functional, in_place):
    """fn(a, b) -> loss and what the gradients of a and b must be (a, b need a gradient)."""

    def plain(a, b):
        r = functional([a, b])
        return (r[0] * 3).sum() + r[1].sum()

    def chained(a, b):
        r = functional([a * 2])
        return (r[0] + 1).sum() + b.sum()

    def in_place_on_clones(a, b):
        r = in_place([a.clone(), b.clone()])
        return (r[0] * 3).sum() + r[1].sum()

    return {
        "functional": (plain, (3.0, 1.0)),
        "chain": (chained, (2.0, 1.0)),
        "in_place": (in_place_on_clones, (3.0, 1.0)),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_wait_ops_are_the_identity_to_autograd(compiled):
    functional, in_place = _ops()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    torch._dynamo.reset()
    counters.clear()
    for name, (fn, (ga, gb)) in _identity_cases(functional, in_place).items():
        run = torch.compile(fn, fullgraph=True, backend="inductor") if compiled else fn
        for i in range(3):  # fresh shapes would recompile: the same shape, fresh data
            a = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
            b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
            loss = run(a, b)
            loss.backward()
            assert torch.equal(a.grad, torch.full_like(a, ga)), (name, i, a.grad)
            assert torch.equal(b.grad, torch.full_like(b, gb)), (name, i, b.grad)
    if compiled:
        assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_wait_ops_values_aliasing_and_requires_grad(compiled):
    functional, in_place = _ops()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    torch._dynamo.reset()

    def fwd(a, b):
        return functional([a, b])

    def fwd_(a, b):
        return in_place([a, b])

    f = torch.compile(fwd, fullgraph=True) if compiled else fwd
    f_ = torch.compile(fwd_, fullgraph=True) if compiled else fwd_
    a, b = _rand(g), _rand(g)
    out = f(a, b)
    assert len(out) == 2 and torch.equal(out[0], a) and torch.equal(out[1], b)
    # the functional form returns new tensors: writing them leaves the inputs alone
    assert out[0].data_ptr() != a.data_ptr()
    out[0].add_(1)
    assert not torch.equal(out[0], a)
    assert not any(t.requires_grad for t in out)
    # where one input needs a gradient, every output does (one node for the list)
    out = f(a.clone().requires_grad_(), b)
    assert all(t.requires_grad for t in out), [t.requires_grad for t in out]
    # the in-place form gives its inputs back, unchanged
    a0, b0 = a.clone(), b.clone()
    out = f_(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert out[0].data_ptr() == a.data_ptr() and out[1].data_ptr() == b.data_ptr()
    if not compiled:
        assert out[0] is a and out[1] is b


def test_wait_ops_second_order():
    functional, _ = _ops()
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = functional([x * x])[0]
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert gx.requires_grad and torch.equal(gx.detach(), 2 * x.detach())
    (g2,) = torch.autograd.grad(gx.sum(), x)
    assert torch.equal(g2, torch.full_like(x, 2.0))


class _CountingWork:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True


def test_async_tensor_waits_once_and_is_its_tensor_to_autograd():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    w = _CountingWork()
    a = TorchCommsAsyncTensor(y, w)
    assert w.waits == 0 and not a.completed
    assert a.grad_fn is y.grad_fn and not a.is_leaf
    s = a.sum()  # the first use waits
    assert w.waits == 1 and a.completed
    assert type(s) is torch.Tensor
    (a * 1).sum()
    assert w.waits == 1  # once
    s.backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    leaf = TorchCommsAsyncTensor(x, None)
    assert leaf.is_leaf and leaf.wait() is x
    g = torch.randn(3)
    leaf.grad = g
    assert x.grad is g and leaf.grad is g

    # a wait that raises is raised by the use that waited, and tried again by the next use
    class _Failing:
        def __init__(self):
            self.calls = 0

        def wait(self):
            self.calls += 1
            raise RuntimeError("the call failed")

    bad = _Failing()
    b = TorchCommsAsyncTensor(torch.ones(2), bad)
    for i in (1, 2):
        with pytest.raises(RuntimeError, match="the call failed"):
            b + 1
        assert bad.calls == i and not b.completed
    with pytest.raises(TypeError, match="elem must be a torch.Tensor"):
        TorchCommsAsyncTensor([1, 2], None)
    with pytest.raises(TypeError, match="wait"):
        TorchCommsAsyncTensor(x, object())


DELAY = 1.0


def wait_ops_wait_for_pending_calls(comm, rank, size):
    """The last rank joins each all_reduce DELAY seconds late. A compiled function that issues
    two async all_reduces and then, instead of the works' wait(), calls the functional wait
    operator on one tensor and the in-place one on the other, must return the sums on every
    rank; the control (a compiled read of the tensor with no wait) must see it unreduced on the
    ranks that were on time. Then TorchCommsAsyncTensor over an eager async call: its first use
    gives the sum."""
    functional, in_place = _ops()
    late = rank == size - 1
    total = float(sum(range(size)))

    def waited(t, u):
        comm.all_reduce(t, ReduceOp.SUM, True)
        comm.all_reduce(u, ReduceOp.SUM, True)
        return functional([t])[0] + 0, in_place([u])[0] + 0

    def no_wait(t, u):  # the control
        comm.all_reduce(t, ReduceOp.SUM, True)
        return t + 0, u

    for fn in (waited, no_wait):
        torch._dynamo.reset()
        run = torch.compile(fn, fullgraph=True, backend="inductor")
        for compile_call in (True, False):
            t, u = torch.full((4,), float(rank)), torch.full((3,), float(rank) + 1)
            comm.barrier(False)
            if late and not compile_call:
                time.sleep(DELAY)
            out, out_u = run(t, u)
            torch.ops._c10d_functional.wait_tensor(t)  # the control's call, ended
            if fn is waited:
                assert torch.equal(out, torch.full((4,), total)), out
                assert torch.equal(out_u, torch.full((3,), total + size)), out_u
            elif not late and not compile_call:
                assert torch.equal(
                    out, torch.full((4,), float(rank))
                ), f"control: the read saw the call's result {out}"
            assert torch.equal(t, torch.full((4,), total)), (fn.__name__, t)

    t = torch.full((4,), float(rank))
    comm.barrier(False)
    if late:
        time.sleep(DELAY)
    a = TorchCommsAsyncTensor(t, comm.all_reduce(t, ReduceOp.SUM, True))
    assert torch.equal(a * 1, torch.full((4,), total)), a.elem
    assert a.completed


def test_wait_ops_wait_for_pending_calls(world):
    world(wait_ops_wait_for_pending_calls, 2)


def test_wait_ops_wait_for_pending_calls_world3(world):
    world(wait_ops_wait_for_pending_calls, 3)
