# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A developer benchmark (not a test): the host time a Python caller pays per collective at a
small size, one GPU, world 1 (NCCL runs a one-rank communicator; what is measured is the issue
path, not the transfer): torch.distributed's own NCCL process group against a fastcomms nccl
communicator called directly (TorchComm, sync and async) and through a torch.distributed process
group over it (fastcomms.device_mesh, the path DeviceMesh, FSDP2 and DDP take), and through a
second such group with the C++ fast path off ("pg python": NOTE [process group fast path], the
round trip through Python it replaces); all_reduce also on a third communicator with a
FlightRecorderHook registered, directly and through its group ("+fr": issue 54's hooks in C++).
Back-to-back calls timed with perf_counter (no synchronization inside a round), median of 7
rounds of 300.
Usage: [PROFILE=1] python3 tools/gpu/bench_host_comm.py
"""

import datetime
import os
import tempfile

import torch


def main():
    import fastcomms
    import torch.distributed as dist
    from _bench_common import host_per_call
    from fastcomms.device_mesh import _create_torchcomm_process_group

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "s"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)

        def comm_and_group(name):
            c = fastcomms.new_comm(
                "nccl",
                dev,
                name,
                store=dist.PrefixStore(name, store),
                timeout=datetime.timedelta(seconds=60),
            )
            return c, _create_torchcomm_process_group(c, f"{name}_pg")

        comm, pg = comm_and_group("host")
        # the same group kind with the fast path off (NOTE [process group fast path]): a second
        # communicator whose process group must take the Python round trip, for the comparison
        slow, pg_py = comm_and_group("host_slow")
        slow._fast = None
        # and one with a flight recorder registered (issue 54: within 1.2x of the call without)
        from fastcomms.hooks import FlightRecorderHook

        rec, pg_rec = comm_and_group("host_fr")
        recorder = FlightRecorderHook(max_entries=2048)
        recorder.register_with_comm(rec)
        t = torch.ones(1024, device=dev)
        out = torch.empty(1024, device=dev)
        sum_ = fastcomms.ReduceOp.SUM
        rows = {
            "all_reduce": {
                "torch nccl": lambda: dist.all_reduce(t),
                "fastcomms": lambda: comm.all_reduce(t, sum_, False),
                "fastcomms async": lambda: comm.all_reduce(t, sum_, True),
                "fastcomms pg": lambda: dist.all_reduce(t, group=pg),
                "fastcomms pg python": lambda: dist.all_reduce(t, group=pg_py),
                "fastcomms +fr": lambda: rec.all_reduce(t, sum_, False),
                "fastcomms pg +fr": lambda: dist.all_reduce(t, group=pg_rec),
            },
            "all_gather_into_tensor": {
                "torch nccl": lambda: dist.all_gather_into_tensor(out, t),
                "fastcomms": lambda: comm.all_gather_single(out, t, False),
                "fastcomms pg": lambda: dist.all_gather_into_tensor(out, t, group=pg),
                "fastcomms pg python": lambda: dist.all_gather_into_tensor(out, t, group=pg_py),
            },
            "reduce_scatter_tensor": {
                "torch nccl": lambda: dist.reduce_scatter_tensor(out, t),
                "fastcomms": lambda: comm.reduce_scatter_single(out, t, sum_, False),
                "fastcomms pg": lambda: dist.reduce_scatter_tensor(out, t, group=pg),
                "fastcomms pg python": lambda: dist.reduce_scatter_tensor(out, t, group=pg_py),
            },
        }
        print(
            f"bench_host_comm: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"NCCL {torch.cuda.nccl.version()}; µs of host time per call, 4 KiB float32"
        )
        for op, variants in rows.items():
            cells = ", ".join(
                f"{k} {host_per_call(fn, iters=300):.1f}" for k, fn in variants.items()
            )
            print(f"{op}: {cells}")
        if os.environ.get("PROFILE") == "1":  # where the process group's call spends its time
            import cProfile
            import pstats

            for name, fn in (
                ("fastcomms pg", rows["all_reduce"]["fastcomms pg"]),
                ("fastcomms", rows["all_reduce"]["fastcomms"]),
            ):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(2000):
                    fn()
                pr.disable()
                print(f"===== all_reduce, {name}: cProfile over 2000 calls")
                pstats.Stats(pr).sort_stats("tottime").print_stats(14)
        torch.cuda.synchronize()
        recorder.unregister()
        comm.finalize()
        slow.finalize()
        rec.finalize()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
