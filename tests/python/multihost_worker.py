# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One rank of tests/python/test_multihost.py, started inside a network namespace:
multihost_worker.py RANK SIZE STORE_ADDR STORE_PORT MY_ADDR RESULT_FILE [TIMEOUT_S]. Every op's
result is checked against values each rank computes for every rank; the outcome goes to
RESULT_FILE."""

import datetime
import json
import os
import sys
import time
import traceback

import torch


def ring_and_2d(comm, rank, n):
    """The ring exchange and the 2-D (ring x ulysses) group across the hosts, bit-exact against
    what a single process computes from every rank's inputs; the USP attention of
    examples/usp_attention.py against single-process attention."""
    from fastcomms.ring import RingGroup
    from fastcomms.sequence_parallel import SequenceParallelGroup

    def data(step, r):
        g = torch.Generator().manual_seed(1000 * step + r)
        return [torch.randn(2, 5, generator=g), torch.randint(0, 99, (3,), generator=g)]

    ring = RingGroup(comm)
    held = []
    for step, reverse in enumerate((False, True, False, False)):
        got = ring.exchange(data(step, rank), reverse=reverse).wait()
        src = (rank + 1) % n if reverse else (rank - 1) % n
        for a, b in zip(got, data(step, src), strict=True):
            assert torch.equal(a, b), (step, reverse)
        held.append(got)
    # the double buffer: the last two results intact, step k+2 in step k's memory
    for a, b in zip(held[2], data(2, (rank - 1) % n), strict=True):
        assert torch.equal(a, b)
    assert held[3][0].data_ptr() == held[1][0].data_ptr()
    # the 2-D group: ranks 0-1 and 2-3 are Ulysses groups (across the namespaces, placed
    # alternately), ranks {0, 2} and {1, 3} rings
    sp = SequenceParallelGroup((2, n // 2), group=comm)
    u = sp.ulysses_size
    assert (sp.ring_rank, sp.ulysses_rank) == divmod(rank, u)
    # the Ulysses all-to-all of the whole sequence, then the ring exchange of the result
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 8 * n, 2 * u, 4, generator=gen)  # the whole sequence, every rank alike
    y = sp.ulysses.all_to_all_4d(sp.shard(x))
    ring_part = x.chunk(sp.ring_size, dim=1)[sp.ring_rank]
    assert torch.equal(y, ring_part.chunk(u, dim=2)[sp.ulysses_rank])
    z = sp.ring.exchange(y).wait()
    prev_ring = x.chunk(sp.ring_size, dim=1)[(sp.ring_rank - 1) % sp.ring_size]
    assert torch.equal(z, prev_ring.chunk(u, dim=2)[sp.ulysses_rank])
    # USP attention (causal zig-zag and not, grouped-query) against single-process attention
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    )
    import usp_attention

    usp_attention.run_checks(sp, log=lambda *a: None)
    sp.destroy()
    ring.destroy()


def main():
    rank, size = int(sys.argv[1]), int(sys.argv[2])
    addr, port, me, out = sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    done, t0 = [], time.monotonic()
    try:
        timeout = datetime.timedelta(seconds=float(sys.argv[7]) if len(sys.argv) > 7 else 30)
        # no store passed: new_comm starts (rank 0) or reaches the TCPStore at MASTER_ADDR
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        # gloo listens on this namespace's address (its default is the loopback)
        hints = {"gloo.hostname": me}
        comm = fastcomms.new_comm("gloo", "cpu", "mh", timeout=timeout, hints=hints)
        n, k, S = size, 3, fastcomms.ReduceOp.SUM
        t = torch.full((k,), float(rank + 1))
        comm.all_reduce(t, S, False)
        assert torch.equal(t, torch.full((k,), float(n * (n + 1) // 2)))
        done.append("all_reduce")
        t = torch.full((k,), float(rank))
        comm.broadcast(t, n - 1, False)
        assert torch.equal(t, torch.full((k,), float(n - 1)))
        done.append("broadcast")
        out_t = torch.empty(n * k)
        comm.all_gather_single(out_t, torch.full((k,), float(rank)), False)
        assert torch.equal(out_t, torch.arange(n).repeat_interleave(k).float())
        done.append("all_gather_single")
        rs = torch.empty(k)
        comm.reduce_scatter_single(rs, torch.full((n * k,), float(rank + 1)), S, False)
        assert torch.equal(rs, torch.full((k,), float(n * (n + 1) // 2)))
        done.append("reduce_scatter_single")
        inp = (rank * n + torch.arange(n)).repeat_interleave(k).float()
        a2a = torch.empty(n * k)
        comm.all_to_all_single(a2a, inp, False)
        assert torch.equal(a2a, (torch.arange(n) * n + rank).repeat_interleave(k).float())
        done.append("all_to_all_single")
        got = torch.empty(k)
        b = comm.batch_op_create()
        b.send(torch.full((k,), float(rank)), (rank + 1) % n)
        b.recv(got, (rank - 1) % n)
        b.issue(False)
        assert torch.equal(got, torch.full((k,), float((rank - 1) % n)))
        done.append("send/recv")
        comm.barrier(False)
        done.append("barrier")
        # a split across the namespaces: even ranks and odd ranks
        sub = comm.split([r for r in range(n) if r % 2 == rank % 2], "parity")
        t = torch.full((k,), float(rank))
        sub.all_reduce(t, S, False)
        assert torch.equal(
            t, torch.full((k,), float(sum(r for r in range(n) if r % 2 == rank % 2)))
        )
        done.append("split")
        # the Ulysses op (the collective path across hosts)
        g = UlyssesGroup(comm)
        xs = [
            torch.randn(2, 3, 2 * n, 8, generator=torch.Generator().manual_seed(q))
            for q in range(n)
        ]
        y = g.all_to_all_4d(xs[rank])
        assert torch.equal(y, torch.cat([x[:, :, 2 * rank : 2 * rank + 2] for x in xs], dim=1))
        assert torch.equal(g.all_to_all_4d(y, mode=1), xs[rank])
        done.append(f"ulysses ({g.transport})")
        # the hierarchical path (NOTE [hierarchical split]): the namespaces share a host name, so
        # each rank names its namespace as its host
        os.environ["FASTCOMMS_HOST_ID"] = me
        h = UlyssesGroup(comm, transport="hierarchical")
        assert h.transport == "hierarchical" and "span 2 hosts" in h.transport_reason
        seq, heads = [1, 4, 2, 3], [2, 1, 3, 2]  # uneven, world 4
        xh = torch.randn(2, seq[rank], sum(heads), 8, generator=torch.Generator().manual_seed(rank))
        kw = {"seq_splits": seq, "head_splits": heads}
        yh = h.all_to_all_4d(xh, **kw)
        assert torch.equal(yh, g.all_to_all_4d(xh, **kw))
        assert torch.equal(h.all_to_all_4d(yh, mode=1, **kw), xh)
        h.destroy()
        done.append("hierarchical ulysses")
        ring_and_2d(comm, rank, n)
        done += ["ring", "2-D group", "usp attention"]
        sub.finalize()
        comm.finalize()
        result = {"ok": True, "done": done}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {
            "ok": False,
            "done": done,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-2000:],
        }
    result["seconds"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
