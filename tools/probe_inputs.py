# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The bad-input probe (issue 16): what a new user's mistakes do on CPU (gloo, world 2).

Every case is one call every rank makes with a bad argument (or, in the "mismatched" category,
rank 1 makes another call than rank 0). Each case ends in one of:
  clear error   every rank raised an exception whose message names the rank and the op
                ("[rank r/n ...]") or the argument (a torch type error before we see it)
  bare error    every rank raised, but the message names neither (counted, not a pass)
  accepted      a rank returned as if the call were right (a silently wrong or ignored input)
  hang          no answer within the hang limit (the communicator's timeout is 10 s)
  crash         a rank's process died
A crash or hang ends the world; the probe starts a fresh one at the next case.

  python tools/probe_inputs.py [--json FILE] [--hang-s 30] [--check-calls 0|1]
Prints a table per category (rich) and exits 1 unless every case is a clear error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import sys
import tempfile
import time
import traceback

import torch

TIMEOUT = datetime.timedelta(seconds=10)


def _cases(check_calls="1"):
    """[(category, name, fn(comm, rank, size))]; fn raises for a bad call."""
    import fastcomms
    from fastcomms import ReduceOp
    from fastcomms.ulysses import UlyssesGroup

    S = ReduceOp.SUM
    out = []

    def case(cat, name):
        def deco(fn):
            out.append((cat, name, fn))
            return fn

        return deco

    # -- tensors that cannot be communicated as given -------------------------------------------
    bad_tensors = {
        "non-contiguous": lambda: torch.ones(8, 2).t(),
        "meta": lambda: torch.empty(8, device="meta"),
        "sparse": lambda: torch.ones(8).to_sparse(),
        "complex on a reduction": lambda: torch.ones(8, dtype=torch.complex64),
        "not a tensor": lambda: [1.0] * 8,
    }
    ops = {
        "all_reduce": lambda c, t: c.all_reduce(t, S, False),
        "broadcast": lambda c, t: c.broadcast(t, 0, False),
        "reduce": lambda c, t: c.reduce(t, 0, S, False),
        "all_gather_single": lambda c, t: c.all_gather_single(torch.empty(16), t, False),
        "reduce_scatter_single": lambda c, t: c.reduce_scatter_single(torch.empty(4), t, S, False),
        "all_to_all_single": lambda c, t: c.all_to_all_single(torch.empty(8), t, False),
    }
    for tname, make in bad_tensors.items():
        for oname, op in ops.items():
            if tname == "complex on a reduction" and oname not in (
                "all_reduce",
                "reduce",
                "reduce_scatter_single",
            ):
                continue
            case("tensor arguments", f"{oname}: {tname}")(
                lambda c, r, n, op=op, make=make: op(c, make())
            )

    # -- sizes ------------------------------------------------------------------------------------
    sizes = {
        "all_gather_single output too small": lambda c, r, n: c.all_gather_single(
            torch.empty(8 * n - 1), torch.ones(8), False
        ),
        "all_gather_single output too large": lambda c, r, n: c.all_gather_single(
            torch.empty(8 * n + 1), torch.ones(8), False
        ),
        "all_gather_single dtype differs": lambda c, r, n: c.all_gather_single(
            torch.empty(8 * n, dtype=torch.int32), torch.ones(8), False
        ),
        "reduce_scatter_single input not size * output": lambda c, r, n: c.reduce_scatter_single(
            torch.empty(4), torch.ones(4 * n + 1), S, False
        ),
        "all_to_all_single sizes differ": lambda c, r, n: c.all_to_all_single(
            torch.empty(8), torch.ones(10), False
        ),
        "all_to_all_single not divisible": lambda c, r, n: c.all_to_all_single(
            torch.empty(7), torch.ones(7), False
        ),
        "all_to_all_v_single splits of wrong length": lambda c, r, n: c.all_to_all_v_single(
            torch.empty(8), torch.ones(8), [8], [8], False
        ),
        "all_to_all_v_single negative split": lambda c, r, n: c.all_to_all_v_single(
            torch.empty(8), torch.ones(8), [10, -2], [10, -2], False
        ),
        "all_to_all_v_single splits sum to another size": lambda c, r, n: c.all_to_all_v_single(
            torch.empty(8), torch.ones(8), [3, 3], [3, 3], False
        ),
        "all_to_all_v_single splits overflow int64": lambda c, r, n: c.all_to_all_v_single(
            torch.empty(8), torch.ones(8), [2**63 - 1, 2**63 - 1], [4, 4], False
        ),
        "all_gather list of wrong length": lambda c, r, n: c.all_gather(
            [torch.empty(4)] * (n + 1), torch.ones(4), False
        ),
        "all_gather list entries of another size": lambda c, r, n: c.all_gather(
            [torch.empty(5)] * n, torch.ones(4), False
        ),
        "scatter list of wrong length": lambda c, r, n: c.scatter(
            torch.empty(4), [torch.ones(4)] * (n + 1) if r == 0 else [], 0, False
        ),
        "gather output list of wrong length": lambda c, r, n: c.gather(
            [torch.empty(4)] * (n + 1) if r == 0 else [], torch.ones(4), 0, False
        ),
    }
    for name, fn in sizes.items():
        case("sizes", name)(fn)

    # -- ranks, roots, peers ----------------------------------------------------------------------
    ranks = {
        "broadcast root -1": lambda c, r, n: c.broadcast(torch.ones(4), -1, False),
        "broadcast root = size": lambda c, r, n: c.broadcast(torch.ones(4), n, False),
        "reduce root = size": lambda c, r, n: c.reduce(torch.ones(4), n, S, False),
        "gather root -1": lambda c, r, n: c.gather([], torch.ones(4), -1, False),
        "send to self": lambda c, r, n: c.send(torch.ones(4), r, False),
        "send to rank = size": lambda c, r, n: c.send(torch.ones(4), n, False),
        "recv from -1": lambda c, r, n: c.recv(torch.empty(4), -1, False),
        "split with a rank twice": lambda c, r, n: c.split([0, 0, 1], "dup"),
        "split with rank = size": lambda c, r, n: c.split([0, n], "oob"),
        "split without the caller": lambda c, r, n: c.split([1 - r], "other"),
        "batch send to rank = size": lambda c, r, n: _batch_send(c, n),
    }
    for name, fn in ranks.items():
        case("ranks and peers", name)(fn)

    # -- reductions -------------------------------------------------------------------------------
    reds = {
        # AVG on integers is accepted (a truncating average, as torchcomms)
        "PREMUL_SUM with a 2-element factor": lambda c, r, n: c.all_reduce(
            torch.ones(4), ReduceOp.PREMUL_SUM(torch.ones(2)), False
        ),
        "PREMUL_SUM on int32": lambda c, r, n: c.all_reduce(
            torch.ones(4, dtype=torch.int32), ReduceOp.PREMUL_SUM(2.0), False
        ),
        "a string as the op": lambda c, r, n: c.all_reduce(torch.ones(4), "sum", False),
        "an int as the op": lambda c, r, n: c.all_reduce(torch.ones(4), 0, False),
        "BAND on float32": lambda c, r, n: c.all_reduce(torch.ones(4), ReduceOp.BAND, False),
    }
    for name, fn in reds.items():
        case("reductions", name)(fn)

    # -- timeouts ---------------------------------------------------------------------------------
    tos = {
        "per-op timeout 0": lambda c, r, n: c.all_reduce(
            torch.ones(4), S, False, timeout=datetime.timedelta(0)
        ),
        "per-op timeout -1 s": lambda c, r, n: c.all_reduce(
            torch.ones(4), S, False, timeout=datetime.timedelta(seconds=-1)
        ),
        "new_comm timeout 0": lambda c, r, n: fastcomms.new_comm(
            "gloo", "cpu", "t0", store=c.get_options().store, timeout=datetime.timedelta(0)
        ),
        "unknown backend": lambda c, r, n: fastcomms.new_comm(
            "glooo", "cpu", "bad", store=c.get_options().store, timeout=TIMEOUT
        ),
        "gloo on a CUDA device": lambda c, r, n: fastcomms.new_comm(
            "gloo", "cuda:0", "cuda", store=c.get_options().store, timeout=TIMEOUT
        ),
    }
    for name, fn in tos.items():
        case("timeouts and options", name)(fn)

    # -- the Ulysses op ---------------------------------------------------------------------------
    def ul(c):
        if not hasattr(c, "_probe_ulysses"):
            c._probe_ulysses = UlyssesGroup(c)
        return c._probe_ulysses

    uls = {
        "mode 2": lambda c, r, n: ul(c).all_to_all_4d(torch.ones(1, 2, 2 * n, 4), mode=2),
        "3-D x": lambda c, r, n: ul(c).all_to_all_4d(torch.ones(2, 2 * n, 4)),
        "heads not divisible": lambda c, r, n: ul(c).all_to_all_4d(torch.ones(1, 2, 2 * n + 1, 4)),
        "seq_splits without head_splits": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), seq_splits=[2] * n
        ),
        "splits of wrong length": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), seq_splits=[2] * (n + 1), head_splits=[2] * (n + 1)
        ),
        "negative split": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), seq_splits=[2] * n, head_splits=[-1, 2 * n + 1]
        ),
        "head_splits not x's heads": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), seq_splits=[2] * n, head_splits=[1] * n
        ),
        "out of another shape": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), out=torch.empty(1, 2, 2, 4)
        ),
        "out of another dtype": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), out=torch.empty(1, 2 * n, 2, 4, dtype=torch.float64)
        ),
        "kv_replicas 0": lambda c, r, n: ul(c).all_to_all_4d(torch.ones(1, 2, 1, 4), kv_replicas=0),
        "kv_replicas repeating a head on a rank": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 1, 4), kv_replicas=2 * n
        ),
        "meta out with a real x": lambda c, r, n: ul(c).all_to_all_4d(
            torch.ones(1, 2, 2 * n, 4), out=torch.empty(1, 2 * n, 2, 4, device="meta")
        ),
    }
    for name, fn in uls.items():
        case("the Ulysses op", name)(fn)

    # -- ranks that disagree (rank 1 calls something else) ----------------------------------------
    def mm(a, b):
        return lambda c, r, n: (a if r == 0 else b)(c)

    mism = {
        "all_reduce sizes differ": mm(
            lambda c: c.all_reduce(torch.ones(8), S, False),
            lambda c: c.all_reduce(torch.ones(6), S, False),
        ),
        "all_reduce dtypes differ": mm(
            lambda c: c.all_reduce(torch.ones(8), S, False),
            lambda c: c.all_reduce(torch.ones(8, dtype=torch.int32), S, False),
        ),
        "SUM against MAX": mm(
            lambda c: c.all_reduce(torch.ones(8), S, False),
            lambda c: c.all_reduce(torch.ones(8), ReduceOp.MAX, False),
        ),
        "broadcast roots differ": mm(
            lambda c: c.broadcast(torch.ones(8), 0, False),
            lambda c: c.broadcast(torch.ones(8), 1, False),
        ),
        "shorter broadcast": mm(
            lambda c: c.broadcast(torch.ones(8), 0, False),
            lambda c: c.broadcast(torch.ones(6), 0, False),
        ),
        "all_reduce against broadcast": mm(
            lambda c: c.all_reduce(torch.ones(8), S, False),
            lambda c: c.broadcast(torch.ones(8), 0, False),
        ),
        "all_gather_single sizes differ": mm(
            lambda c: c.all_gather_single(torch.empty(16), torch.ones(8), False),
            lambda c: c.all_gather_single(torch.empty(12), torch.ones(6), False),
        ),
        "Ulysses heads differ": mm(
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 2, 4, 4)),
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 2, 6, 4)),
        ),
        "Ulysses modes differ": mm(
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 2, 4, 4), mode=0),
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 4, 2, 4), mode=1),
        ),
        "Ulysses kv_replicas differ": mm(
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 2, 1, 4), kv_replicas=2),
            lambda c: ul(c).all_to_all_4d(torch.ones(1, 2, 2, 4)),
        ),
    }
    for name, fn in mism.items():
        case(f"mismatched calls (FASTCOMMS_CHECK_CALLS={check_calls})", name)(fn)

    # -- after finalize ---------------------------------------------------------------------------
    def finalized(op):
        def fn(c, r, n):
            c.finalize()
            op(c)

        return fn

    for name, op in {
        "all_reduce after finalize": lambda c: c.all_reduce(torch.ones(4), S, False),
        "split after finalize": lambda c: c.split([0, 1], "late"),
        "barrier after finalize": lambda c: c.barrier(False),
    }.items():
        case("after finalize", name)(finalized(op))
    return out


def _batch_send(c, n):
    b = c.batch_op_create()
    b.send(torch.ones(4), n)
    b.issue(False)


def _clear(msg):
    """The message names the rank and op, or says what was expected (pybind's own type errors
    name the function, the accepted signatures and what it was called with)."""
    return (
        "[rank " in msg
        or "expected" in msg
        or "must" in msg
        or "incompatible function arguments" in msg
    )


def _worker(rank, size, path, start, q, check_calls):
    import fastcomms

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    os.environ["FASTCOMMS_CHECK_CALLS"] = check_calls
    import torch.distributed as dist

    store = dist.FileStore(path, size)
    cases = _cases(check_calls)
    comm = None
    for i in range(start, len(cases)):
        cat, name, fn = cases[i]
        if comm is None:
            comm = fastcomms.new_comm(
                "gloo", "cpu", f"probe{i}", store=dist.PrefixStore(f"p{i}", store), timeout=TIMEOUT
            )
        q.put(("start", rank, i))
        try:
            fn(comm, rank, size)
            q.put(("done", rank, i, "accepted", ""))
        except Exception as e:  # noqa: BLE001 - every outcome is recorded
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:200]
            q.put(("done", rank, i, "error" if _clear(str(e)) else "bare", msg))
        # a fresh communicator after every case: a failed call may leave one unusable, and the
        # next case must not inherit it
        try:
            comm.finalize()
        except Exception:  # noqa: BLE001
            pass
        comm = None
    q.put(("end", rank, len(cases)))


def run(hang_s, check_calls="1"):
    import torch.multiprocessing as mp

    cases = _cases(check_calls)
    results = {}  # index -> (outcome, detail)
    ctx = mp.get_context("spawn")
    start = 0
    size = 2
    while start < len(cases):
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            procs = [
                ctx.Process(
                    target=_worker,
                    args=(r, size, os.path.join(d, "s"), start, q, check_calls),
                    daemon=True,
                )
                for r in range(size)
            ]
            for p in procs:
                p.start()
            current, per_rank, ended = start, {}, set()
            last = time.monotonic()
            failed = None
            while len(ended) < size:
                try:
                    msg = q.get(timeout=0.2)
                    last = time.monotonic()
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        failed = "crash"
                    elif time.monotonic() - last > hang_s:
                        failed = "hang"
                    if failed:
                        break
                    continue
                if msg[0] == "start":
                    current = max(current, msg[2])
                elif msg[0] == "done":
                    _, r, i, outcome, detail = msg
                    per_rank.setdefault(i, {})[r] = (outcome, detail)
                    if len(per_rank[i]) == size:
                        outs = [per_rank[i][q_][0] for q_ in range(size)]
                        detail = next(
                            (per_rank[i][q_][1] for q_ in range(size) if per_rank[i][q_][1]), ""
                        )
                        if all(o == "error" for o in outs):
                            results[i] = ("clear error", detail)
                        elif any(o == "accepted" for o in outs):
                            results[i] = ("accepted", detail or "no error")
                        else:
                            results[i] = ("bare error", detail)
                elif msg[0] == "end":
                    ended.add(msg[1])
            for p in procs:
                p.kill() if failed else p.join(timeout=10)
            if failed:
                results[current] = (failed, "")
                start = current + 1
            else:
                start = len(cases)
    return cases, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--hang-s", type=float, default=30.0)
    ap.add_argument(
        "--check-calls",
        choices=["0", "1", "strict"],
        default="1",
        help="FASTCOMMS_CHECK_CALLS for the run (0: off; 1: the default; strict: every "
        "collective compared before data moves)",
    )
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    cases, results = run(args.hang_s, args.check_calls)
    kinds = ["clear error", "bare error", "accepted", "hang", "crash"]
    table = Table(title="fastcomms input probe (gloo, world 2, CPU)")
    table.add_column("category")
    table.add_column("count", justify="right")
    for k in kinds:
        table.add_column(k, justify="right")
    cats = []
    for cat, _, _ in cases:
        if cat not in cats:
            cats.append(cat)
    total = dict.fromkeys(kinds, 0)
    for cat in cats:
        idx = [i for i, (c, _, _) in enumerate(cases) if c == cat]
        counts = dict.fromkeys(kinds, 0)
        for i in idx:
            counts[results.get(i, ("hang", ""))[0]] += 1
        for k in kinds:
            total[k] += counts[k]
        table.add_row(cat, str(len(idx)), *(str(counts[k]) for k in kinds))
    table.add_row("all", str(len(cases)), *(str(total[k]) for k in kinds))
    console = Console()
    console.print(table)
    for i, (cat, name, _) in enumerate(cases):
        outcome, detail = results.get(i, ("hang", ""))
        if outcome != "clear error":
            console.print(f"  [yellow]{outcome}[/]: {cat} / {name}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "category": c,
                        "case": n,
                        "outcome": results.get(i, ("hang", ""))[0],
                        "detail": results.get(i, ("", ""))[1],
                    }
                    for i, (c, n, _) in enumerate(cases)
                ],
                f,
                indent=1,
            )
    return 0 if total["clear error"] == len(cases) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(2)
