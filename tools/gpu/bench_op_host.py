# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Host cost of one Ulysses call at world 1 on one GPU, and the cost of a call replayed in a CUDA
graph: the figures of issue 36 (the op in C++). One process, world 1 (a FileStore and torch's NCCL
group of one rank; the group over it takes the NVLink transport, whose one-rank call is a copy).

- host: µs of host time per call (perf_counter over back-to-back calls, nothing synchronized
  inside a round, medians of rounds after a warm-up) for zero copy (``out=`` an
  ``empty_output`` buffer), copying, async and the functional form, bf16 (1, 64, 40, 128) and
  (1, 16, 40, 128);
- compiled: the marginal host cost of the call inside ``torch.compile`` (inductor, fullgraph):
  a function with the call and ``+ 1`` minus the same function with ``+ 1`` alone;
- graph: 20 zero-copy calls captured in one CUDA graph, replayed, µs per call (device time by
  events), at (1, 64, 40, 128) and at 10 MiB (1, 1024, 40, 128).

Every result is checked bit-exact before it is timed. Prints one JSON line (``--label`` names
the build) so that runs of two builds, interleaved by the caller, can be set side by side.
A benchmark, not a test. Usage: python3 tools/gpu/bench_op_host.py [--label L] [--rounds 9]"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from _bench_common import graph_per_call, ulysses_calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="build")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import fastcomms
    from fastcomms._bench import host_per_call
    from fastcomms.ulysses import UlyssesGroup
    from fastcomms.ulysses import all_to_all_4d as functional

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
    with_call = torch.compile(lambda t: functional(t, g) + 1, fullgraph=True)
    without = torch.compile(lambda t: t + 1, fullgraph=True)
    assert torch.equal(with_call(x), x + 1)
    eager = per_call(lambda: functional(x, g) + 1)
    cw = per_call(lambda: with_call(x))
    cwo = per_call(lambda: without(x))
    res["compiled (1, 64, 40, 128)"] = {
        "eager call + 1": round(eager, 2),
        "compiled call + 1": round(cw, 2),
        "compiled + 1 alone": round(cwo, 2),
        "marginal compiled call": round(cw - cwo, 2),
    }
    for shape in [(1, 64, 40, 128), (1, 1024, 40, 128)]:
        x = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        res[f"graph replay µs/call {shape}"] = round(graph_per_call(g, x, g.empty_output(x), x), 2)
    g.destroy()
    dist.destroy_process_group()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
