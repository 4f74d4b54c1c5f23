# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Host cost of one Ulysses call at world 1 on one GPU, and the cost of a call replayed in a CUDA
graph: the figures of issue 36 (the op in C++). One process, world 1 (a FileStore and torch's NCCL
group of one rank; the group over it takes the NVLink transport, whose one-rank call is a copy).

- host: µs of host time per call (perf_counter over back-to-back calls, nothing synchronized
  inside a round, medians of rounds after a warm-up) for zero copy (``out=`` an
  ``empty_output`` buffer), copying, async and the functional form, bf16 (1, 64, 40, 128) and
  (1, 16, 40, 128);
- compiled, split: the marginal host cost of the call inside ``torch.compile`` (inductor,
  fullgraph: a function with the call and ``+ 1`` minus the same function with ``+ 1`` alone),
  through the functional form and through torch.ops, beside the eager typed and boxed calls, the
  same measure for torch's fallback op ``aten._cdist_forward``, and under
  ``mode="reduce-overhead"`` (``_compiled_split``); beside each, the matched eager figure: the
  compiled ``+ 1`` alone followed by the eager call and ``+ 1``, minus that alone and
  ``torch.add`` (what the eager call costs next to compiled code);
- graph: 20 zero-copy calls captured in one CUDA graph, replayed, µs per call (device time by
  events), at (1, 64, 40, 128) and at 10 MiB (1, 1024, 40, 128), interleaved with fast-ulysses'
  where its build is importable (tools/gpu/build_anchor.sh).

Every result is checked bit-exact before it is timed. Prints one JSON line (``--label`` names
the build) so that runs of two builds, interleaved by the caller, can be set side by side.
A benchmark, not a test. Usage: python3 tools/gpu/bench_op_host.py [--label L] [--rounds 9]"""

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
from _bench_common import graph_per_call, ulysses_calls


def _compiled_split(g, x, rounds):
    """Where the compiled call's host time goes: the eager call through the extension's typed
    dispatcher call and through torch.ops (the boxed call compiled code makes), each alone and
    followed by ``+ 1`` (the eager cost in the compiled function's context), and compiled
    functions calling the functional form, torch.ops directly (no functional-form guards), and
    ``+ 1`` alone; the variants interleaved round by round."""
    from _bench_common import host_per_call
    from fastcomms import _C
    from fastcomms.ulysses import all_to_all_4d as functional

    gid = g._id
    op = torch.ops.fastcomms.ulysses_all_to_all_4d.default
    variants = {
        "eager typed": lambda: _C.ulysses_all_to_all_4d(x, gid, 0, None, None, 1),
        "eager torch.ops": lambda: op(x, gid, 0, None, None, 1),
        "eager functional": lambda: functional(x, g),
        "torch.add": lambda: torch.add(x, 1),
        "eager typed + 1": lambda: _C.ulysses_all_to_all_4d(x, gid, 0, None, None, 1) + 1,
        "eager functional + 1": lambda: functional(x, g) + 1,
        "compiled functional + 1": torch.compile(lambda t: functional(t, g) + 1, fullgraph=True),
        "compiled torch.ops + 1": torch.compile(
            lambda t: op(t, gid, 0, None, None, 1) + 1, fullgraph=True
        ),
        "compiled + 1 alone": torch.compile(lambda t: t + 1, fullgraph=True),
    }
    alone_fn = variants["compiled + 1 alone"]
    for k, fn in variants.items():
        fn = variants[k] = fn if not k.startswith("compiled") else (lambda f=fn: f(x))
        assert torch.equal(fn(), x + 1 if "+ 1" in k or k == "torch.add" else x), k
    # beside: the compiled ``+ 1`` alone, then the eager call (+ 1): what the eager call costs
    # next to compiled code, the matched eager figure of the compiled marginal
    variants |= {
        "beside: compiled + 1 alone, then eager functional + 1": lambda: (
            alone_fn(x),
            functional(x, g) + 1,
        ),
        "beside: compiled + 1 alone, then eager torch.ops + 1": lambda: (
            alone_fn(x),
            op(x, gid, 0, None, None, 1) + 1,
        ),
    }
    # The same measure for one of torch's own ops that inductor always leaves as a fallback call
    # (aten._cdist_forward, lowering.py's make_fallback): what torch's compiled runtime adds to
    # any such call, ours or aten's.
    a, b = torch.randn(64, 16, device=x.device), torch.randn(64, 16, device=x.device)
    cd = torch.ops.aten._cdist_forward.default
    r = cd(a, b, 2.0, None)
    with_cd = torch.compile(lambda t: cd(t, b, 2.0, None) + 1, fullgraph=True)
    cd_alone = torch.compile(lambda t: t + 1, fullgraph=True)
    variants |= {
        "aten beside: compiled + 1 alone, then eager + 1": lambda: (
            cd_alone(r),
            cd(a, b, 2.0, None) + 1,
        ),
        "aten fallback eager": lambda: cd(a, b, 2.0, None),
        "aten fallback eager + 1": lambda: cd(a, b, 2.0, None) + 1,
        "aten torch.add": lambda: torch.add(r, 1),
        "aten fallback compiled + 1": lambda: with_cd(a),
        "aten compiled + 1 alone": lambda: cd_alone(r),
    }
    assert torch.allclose(with_cd(a), r + 1) and torch.equal(cd_alone(r), r + 1)
    # mode="reduce-overhead": inductor's CUDA graphs replay the compiled function, host work
    # included, so what a call adds there is what the graph's replay adds
    try:
        ro = torch.compile(lambda t: functional(t, g) + 1, mode="reduce-overhead", fullgraph=True)
        ro_alone = torch.compile(lambda t: t + 1, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # cudagraph trees record on a later call than the first
            assert torch.equal(ro(x), x + 1) and torch.equal(ro_alone(x), x + 1)
        variants |= {
            "reduce-overhead functional + 1": lambda: ro(x),
            "reduce-overhead + 1 alone": lambda: ro_alone(x),
        }
        ro_error = None
    except Exception as e:  # noqa: BLE001 - recorded in the result, not fatal to the run
        ro_error = f"{type(e).__name__}: {e}"[:300]
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            samples[k].append(host_per_call(fn, rounds=1, warmup=30))
    m = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    alone = m["compiled + 1 alone"]
    m["marginal compiled functional"] = round(m["compiled functional + 1"] - alone, 2)
    m["marginal compiled torch.ops"] = round(m["compiled torch.ops + 1"] - alone, 2)
    m["marginal eager functional (call + 1 minus torch.add)"] = round(
        m["eager functional + 1"] - m["torch.add"], 2
    )
    if ro_error is not None:
        m["reduce-overhead"] = ro_error
    else:
        m["marginal reduce-overhead functional"] = round(
            m["reduce-overhead functional + 1"] - m["reduce-overhead + 1 alone"], 2
        )
    m["aten fallback: marginal compiled"] = round(
        m["aten fallback compiled + 1"] - m["aten compiled + 1 alone"], 2
    )
    m["aten fallback: marginal eager (call + 1 minus torch.add)"] = round(
        m["aten fallback eager + 1"] - m["aten torch.add"], 2
    )
    # the matched eager figures: (alone, then eager call + 1) minus alone minus torch.add
    for name, beside, add, alone_k in (
        ("functional", "beside: compiled + 1 alone, then eager functional + 1", "torch.add", None),
        ("torch.ops", "beside: compiled + 1 alone, then eager torch.ops + 1", "torch.add", None),
        (
            "aten fallback",
            "aten beside: compiled + 1 alone, then eager + 1",
            "aten torch.add",
            "aten compiled + 1 alone",
        ),
    ):
        m[f"marginal eager {name} beside compiled"] = round(
            m[beside] - m[alone_k or "compiled + 1 alone"] - m[add], 2
        )
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="build")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import fastcomms
    from _bench_common import host_per_call
    from fastcomms.ulysses import UlyssesGroup

    def per_call(fn):  # µs of host time per call: rounds of 200 calls after 30 warm-up calls
        return host_per_call(fn, rounds=args.rounds, warmup=30)

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group(
        "nccl", store=dist.FileStore(path, 1), rank=0, world_size=1, device_id=dev
    )
    g = UlyssesGroup(None, device=dev)
    res = {"label": args.label, "transport": g.transport, "fastcomms": fastcomms.__file__}
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in [(1, 16, 40, 128), (1, 64, 40, 128)]:
        x = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        zo = g.empty_output(x)
        calls = ulysses_calls(g, x, zo)
        assert torch.equal(calls["zero"](), x) and torch.equal(zo, x)
        assert torch.equal(calls["copy"](), x) and torch.equal(calls["async"]().wait(), x)
        assert torch.equal(calls["functional"](), x)
        res[f"host {shape}"] = {k: round(per_call(fn), 2) for k, fn in calls.items()}
    x = torch.randn((1, 64, 40, 128), generator=gen, device=dev, dtype=torch.bfloat16)
    res["compiled, split (1, 64, 40, 128)"] = _compiled_split(g, x, args.rounds)
    try:  # the anchor beside us where its build is on the path (tools/gpu/build_anchor.sh)
        import fast_ulysses

        fu = fast_ulysses.UlyssesGroup(None, device=dev)
        res["anchor"] = f"fast-ulysses {fast_ulysses.__version__}"
    except ImportError as e:
        fu, res["anchor"] = None, f"not importable ({e})"
    for shape in [(1, 64, 40, 128), (1, 1024, 40, 128)]:
        x = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        lanes = {"fastcomms": g, "fast-ulysses": fu} if fu is not None else {"fastcomms": g}
        reps = {k: [] for k in lanes}
        for _ in range(3):  # the lanes interleaved, three times each
            for k, grp in lanes.items():
                reps[k].append(graph_per_call(grp, x, grp.empty_output(x), x))
        res[f"graph replay µs/call {shape}"] = {
            k: round(statistics.median(v), 2) for k, v in reps.items()
        }
    if fu is not None:
        fu.destroy()
    g.destroy()
    dist.destroy_process_group()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
