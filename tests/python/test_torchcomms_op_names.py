# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' per-method operators (NOTE [torchcomms method ops]): after ``import fastcomms``,
``torch.ops.torchcomms.torchcomm_<method>_`` (in place) and ``torchcomm_<method>`` (functional)
exist with torchcomms' schemas and run on fastcomms communicators, eagerly and inside
torch.compile(fullgraph=True): bit-exact against torch.distributed on gloo (2 processes), the
in-place op writing the caller's (poisoned) tensor and returning it, the functional op leaving
its inputs as they are and returning new tensors, ``async_op`` waited through
``torchcomm_wait_tensors_``. Schemas written from torchcomms' registrations
(functional/collectives.py, registry.py, param_parsing.py)."""

import os
import subprocess
import sys

import fastcomms  # noqa: F401  (defines the operators)
import torch
import torch._dynamo
import torch.distributed as dist
from fastcomms import ReduceOp

OPS = torch.ops.torchcomms
_TAIL = "bool async_op, Dict(str, str)? hints, PyObject? timeout"

# torchcomms' schemas as torch prints them (an opaque type prints as PyObject), in-place first
SCHEMAS = {
    "torchcomm_all_reduce_": (
        f"PyObject self, Tensor(a!) tensor, PyObject op, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_all_reduce": (f"PyObject self, Tensor tensor, PyObject op, {_TAIL}", "Tensor"),
    "torchcomm_reduce_": (
        f"PyObject self, Tensor(a!) tensor, int root, PyObject op, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_broadcast_": (f"PyObject self, Tensor(a!) tensor, int root, {_TAIL}", "Tensor(a!)"),
    "torchcomm_barrier": (f"PyObject self, {_TAIL}", "Tensor?"),
    "torchcomm_all_gather_": (
        f"PyObject self, Tensor(a!)[] tensor_list, Tensor tensor, {_TAIL}",
        "Tensor(a!)[]",
    ),
    "torchcomm_all_gather": (
        f"PyObject self, Tensor[] tensor_list, Tensor tensor, {_TAIL}",
        "Tensor[]",
    ),
    "torchcomm_send": (f"PyObject self, Tensor tensor, int dst, {_TAIL}", "Tensor?"),
    "torchcomm_recv_": (f"PyObject self, Tensor(a!) tensor, int src, {_TAIL}", "Tensor(a!)"),
    "torchcomm_all_gather_single_": (
        f"PyObject self, Tensor(a!) output, Tensor input, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_all_gather_v_": (
        f"PyObject self, Tensor(a!)[] tensor_list, Tensor tensor, {_TAIL}",
        "Tensor(a!)[]",
    ),
    "torchcomm_reduce_scatter_single_": (
        f"PyObject self, Tensor(a!) output, Tensor input, PyObject op, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_reduce_scatter_v_": (
        f"PyObject self, Tensor(a!) output, Tensor[] input_list, PyObject op, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_all_to_all_single_": (
        f"PyObject self, Tensor(a!) output, Tensor input, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_all_to_all_v_single_": (
        "PyObject self, Tensor(a!) output, Tensor input, int[] output_split_sizes, "
        f"int[] input_split_sizes, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_all_to_all_": (
        f"PyObject self, Tensor(a!)[] output_tensor_list, Tensor[] input_tensor_list, {_TAIL}",
        "Tensor(a!)[]",
    ),
    "torchcomm_reduce_scatter_": (
        f"PyObject self, Tensor(a!) output, Tensor[] input_list, PyObject op, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_scatter_": (
        f"PyObject self, Tensor(a!) output_tensor, Tensor[] input_tensor_list, int root, {_TAIL}",
        "Tensor(a!)",
    ),
    "torchcomm_gather_": (
        f"PyObject self, Tensor(a!)[] output_tensor_list, Tensor input_tensor, int root, {_TAIL}",
        "Tensor(a!)[]",
    ),
    "torchcommwindow_put": (
        "PyObject self, Tensor tensor, int dst_rank, int target_disp, bool async_op",
        "Tensor?",
    ),
    "torchcommwindow_signal": ("PyObject self, int dst_rank, bool async_op", "Tensor?"),
    "torchcommwindow_wait_signal": ("PyObject self, int peer_rank, bool async_op", "Tensor?"),
    "torchcommwindow_map_remote_tensor": ("PyObject self, int rank", "Tensor"),
    "batchsendrecv_send": ("PyObject self, Tensor tensor, int dst", "()"),
    "batchsendrecv_recv_": ("PyObject self, Tensor(a!) tensor, int src", "Tensor(a!)"),
    "batchsendrecv_recv": ("PyObject self, Tensor tensor, int src", "Tensor"),
}
# the writing methods: an in-place op and a functional one each
WRITING = (
    "all_reduce reduce broadcast all_gather recv all_gather_single all_gather_v "
    "reduce_scatter_single reduce_scatter_v all_to_all_single all_to_all_v_single all_to_all "
    "reduce_scatter scatter gather"
).split()


def test_ops_exist_with_torchcomms_schemas():
    for name, (args, ret) in SCHEMAS.items():
        schema = getattr(OPS, name).default._schema
        assert str(schema) == f"torchcomms::{name}({args}) -> {ret}", name
    for m in WRITING:  # each writing method: the pair, the functional one without marks
        ip, fn = (
            str(getattr(OPS, f"torchcomm_{m}_").default._schema),
            getattr(OPS, f"torchcomm_{m}"),
        )
        f = str(fn.default._schema)
        assert "!" not in f and f.split("(", 1)[1] == ip.split("(", 1)[1].replace("(a!)", ""), (
            ip,
            f,
        )
    # the ones torchcomms does not define are not defined
    for name in ("torchcomm_gather_single", "torchcomm_send_", "torchcomm_barrier_"):
        assert not hasattr(OPS, name), name


def test_never_redefines_existing_ops():
    """An op of that name defined first (real torchcomms imported earlier) is kept as it is."""
    code = (
        "import torch\n"
        "lib = torch.library.Library('torchcomms', 'FRAGMENT')\n"
        "lib.define('torchcomm_all_reduce(Tensor x) -> Tensor')\n"
        "import fastcomms, fastcomms._torchcomms_ops as m\n"
        "assert not m.register()\n"
        "assert str(torch.ops.torchcomms.torchcomm_all_reduce.default._schema) == "
        "'torchcomms::torchcomm_all_reduce(Tensor x) -> Tensor'\n"
        "assert not hasattr(torch.ops.torchcomms, 'torchcomm_all_reduce_')\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


# -- on 2 ranks: bit-exact against torch.distributed ------------------------------------------
def _rand(rank, *shape, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _poison(like):
    return torch.full_like(like, float("nan"))


def _cases(comm, rank, size):
    """name -> (fn(op_namespace_getter, in_place) -> result, expected): each case runs the op
    in place on a poisoned output (or the caller's tensor) or functionally."""
    x = _rand(rank, 4, 3)
    cases = {}

    exp = x.clone()
    dist.all_reduce(exp)
    cases["all_reduce"] = (lambda: (x.clone(),), lambda t: (comm, t, ReduceOp.SUM), exp)

    exp = x.clone()
    dist.broadcast(exp, 1)
    cases["broadcast"] = (lambda: (x.clone(),), lambda t: (comm, t, 1), exp)

    exp = torch.empty(size * 4, 3, dtype=x.dtype)
    dist.all_gather_into_tensor(exp, x)
    cases["all_gather_single"] = (lambda e=exp: (_poison(e),), lambda t: (comm, t, x), exp)

    big = _rand(rank, size * 2, 3, seed=1)
    exp = torch.empty(2, 3, dtype=x.dtype)
    dist.reduce_scatter_tensor(exp, big)
    cases["reduce_scatter_single"] = (
        lambda e=exp: (_poison(e),),
        lambda t: (comm, t, big, ReduceOp.SUM),
        exp,
    )

    exp = torch.empty_like(big)
    dist.all_to_all_single(exp, big)
    cases["all_to_all_single"] = (lambda e=exp: (_poison(e),), lambda t: (comm, t, big), exp)
    return cases


def _check_eager(comm, rank, size):
    for name, (make, args, exp) in _cases(comm, rank, size).items():
        (t,) = make()
        before = t.clone()
        ip = getattr(OPS, f"torchcomm_{name}_")(*args(t), False, None, None)
        assert ip is t, name  # the caller's tensor, written and returned
        assert torch.equal(t, exp), name
        (t,) = make()
        before = t.clone()
        fn = getattr(OPS, f"torchcomm_{name}")(*args(t), False, None, None)
        assert fn.data_ptr() != t.data_ptr(), name
        assert torch.equal(fn, exp), name
        assert torch.equal(t, before) or (t.isnan().all() and before.isnan().all()), name
    # a list op: all_gather into a poisoned list
    x = _rand(rank, 5, seed=2)
    exp = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(exp, x)
    outs = [_poison(x) for _ in range(size)]
    res = OPS.torchcomm_all_gather_(comm, outs, x, False, None, None)
    assert len(res) == size and all(r is o for r, o in zip(res, outs, strict=True))
    assert all(torch.equal(o, e) for o, e in zip(outs, exp, strict=True))
    res = OPS.torchcomm_all_gather(comm, outs, x, False, None, None)
    assert all(
        torch.equal(r, e) and r.data_ptr() != o.data_ptr()
        for r, e, o in zip(res, exp, outs, strict=False)
    )
    # send / recv: rank 0 sends to 1 (in place: the receive buffer; functional: a new tensor)
    y = _rand(0, 6, seed=3)
    for in_place in (True, False):
        if rank == 0:
            assert OPS.torchcomm_send(comm, y, 1, False, None, None) is None
        else:
            buf = _poison(y)
            if in_place:
                assert OPS.torchcomm_recv_(comm, buf, 0, False, None, None) is buf
                assert torch.equal(buf, y)
            else:
                got = OPS.torchcomm_recv(comm, buf, 0, False, None, None)
                assert torch.equal(got, y) and buf.isnan().all()
    assert OPS.torchcomm_barrier(comm, False, None, None) is None


def _check_async(comm, rank, size):
    wait_, wait = OPS.torchcomm_wait_tensors_, OPS.torchcomm_wait_tensors
    for name, (make, args, exp) in _cases(comm, rank, size).items():
        (t,) = make()
        ip = getattr(OPS, f"torchcomm_{name}_")(*args(t), True, None, None)
        assert ip is t
        wait_([t])
        assert torch.equal(t, exp), name
        (t,) = make()
        fn = getattr(OPS, f"torchcomm_{name}")(*args(t), True, None, None)
        (got,) = wait([fn])
        assert torch.equal(got, exp), name
    done = OPS.torchcomm_barrier(comm, True, None, None)
    assert done.device.type == "cpu" and done.numel() == 0
    wait_([done])
    y = _rand(0, 6, seed=3)
    if rank == 0:
        wait_([OPS.torchcomm_send(comm, y, 1, True, None, None)])
    else:
        buf = _poison(y)
        wait_([OPS.torchcomm_recv_(comm, buf, 0, True, None, None)])
        assert torch.equal(buf, y)


def _check_compiled(comm, rank, size):
    """Under torch.compile: the ops without a ReduceOp argument (NOTE [torchcomms method ops]:
    a ReduceOp is not an opaque type of fastcomms, so the reductions by name run eagerly only)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    x = _rand(rank, 4, 3, seed=4)
    big = _rand(rank, size * 2, 3, seed=5)
    e_ag = torch.empty(size * 4, 3, dtype=x.dtype)
    dist.all_gather_into_tensor(e_ag, x)
    e_a2a = torch.empty_like(big)
    dist.all_to_all_single(e_a2a, big)
    e_bc = x.clone()
    dist.broadcast(e_bc, 0)

    def in_place(ag, a2a, bc):
        OPS.torchcomm_all_gather_single_(comm, ag, x * 1, False, None, None)
        OPS.torchcomm_all_to_all_single_(comm, a2a, big, True, None, None)
        OPS.torchcomm_wait_tensors_([a2a])
        r = OPS.torchcomm_broadcast_(comm, bc, 0, False, None, None)
        return r + 0

    def functional(t, big):
        out = torch.empty(size * 4, 3, dtype=t.dtype)
        g = OPS.torchcomm_all_gather_single(comm, out, t, False, None, None)
        w = OPS.torchcomm_all_to_all_single(comm, torch.empty_like(big), big, True, None, None)
        (w,) = OPS.torchcomm_wait_tensors([w])
        b = OPS.torchcomm_broadcast(comm, t, 1, False, None, None)
        return g, w, b

    e_bc1 = x.clone()
    dist.broadcast(e_bc1, 1)
    run = torch.compile(in_place, fullgraph=True)
    for _ in range(2):
        ag, a2a, bc = _poison(e_ag), _poison(e_a2a), x.clone()
        out = run(ag, a2a, bc)  # the caller's (poisoned) tensors written
        assert torch.equal(ag, e_ag) and torch.equal(a2a, e_a2a)
        assert torch.equal(bc, e_bc) and torch.equal(out, e_bc)
    run = torch.compile(functional, fullgraph=True)
    for _ in range(2):
        t = x.clone()
        g, w, b = run(t, big)
        assert torch.equal(t, x)  # inputs as they were
        assert torch.equal(g, e_ag) and torch.equal(w, e_a2a) and torch.equal(b, e_bc1)

    y = _rand(0, 6, seed=6)

    def p2p(buf):
        if rank == 0:
            OPS.torchcomm_send(comm, buf, 1, False, None, None)
        else:
            OPS.torchcomm_recv_(comm, buf, 0, False, None, None)
        return buf * 2

    run = torch.compile(p2p, fullgraph=True)
    buf = y.clone() if rank == 0 else _poison(y)
    assert torch.equal(run(buf), y * 2) and torch.equal(buf, y)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_eager(world):
    world(_check_eager, 2)


def test_async(world):
    world(_check_async, 2)


def test_compiled(world):
    world(_check_compiled, 2)
