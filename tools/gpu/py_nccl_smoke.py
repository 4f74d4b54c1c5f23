# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One rank of a smoke check of the nccl backend from Python (one process per rank:
py_nccl_smoke.py RANK SIZE STOREFILE; SIZE 1 needs one process). Prints each step, so a crash names
the last one; tools/gpu/debug_py_link.sh runs it against several builds of the library."""

import datetime
import faulthandler
import os
import sys

import torch

faulthandler.enable()


def step(msg):
    print(f"[rank {os.environ['TORCHCOMM_RANK']}] {msg}", flush=True)


def main():
    rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    import torch.distributed as dist

    step("import fastcomms")
    import fastcomms

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    store = dist.FileStore(path, size)
    step("new_comm nccl")
    comm = fastcomms.new_comm(
        "nccl", dev, store=dist.PrefixStore("fc", store), timeout=datetime.timedelta(seconds=60)
    )
    step("all_reduce")
    t = torch.full((1024,), float(rank + 1), device=dev)
    comm.all_reduce(t, fastcomms.ReduceOp.SUM, False)
    torch.cuda.synchronize()
    want = float(sum(r + 1 for r in range(size)))
    assert torch.equal(t, torch.full_like(t, want)), t[:4]
    step("finalize")
    comm.finalize()
    step("ok")


if __name__ == "__main__":
    main()
