# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The public API with type annotations, as an IDE or mypy sees it through the package's
``py.typed`` and the extension's stub (``fastcomms/_C.pyi``, made by scripts/stubs.sh).
scripts/test.sh type-checks this file with mypy; it also runs (one rank over gloo):
``python examples/typed_usage.py``."""

import datetime
import os

import fastcomms
import torch
import torch.distributed as dist
from fastcomms import RedOpType, ReduceOp, TorchComm, TorchWork, WorkStatus
from fastcomms.ulysses import UlyssesGroup


def main() -> None:
    os.environ.setdefault("TORCHCOMM_RANK", "0")
    os.environ.setdefault("TORCHCOMM_SIZE", "1")
    comm: TorchComm = fastcomms.new_comm(
        "gloo",
        torch.device("cpu"),
        "typed",
        store=dist.HashStore(),
        timeout=datetime.timedelta(seconds=30),
    )
    rank: int = comm.get_rank()
    size: int = comm.get_size()
    t = torch.full((4,), float(rank + 1))
    work: TorchWork = comm.all_reduce(t, ReduceOp.SUM, True)
    work.wait()
    kind: RedOpType = RedOpType.SUM
    done: bool = work.is_completed()
    status: WorkStatus = WorkStatus.COMPLETED
    group = UlyssesGroup(comm)
    x = torch.randn(1, 8, 4 * size, 16)
    y: torch.Tensor = group.all_to_all_4d(x)
    group.destroy()
    backends: list[str] = fastcomms.built_backends()
    comm.finalize()
    print(f"rank {rank}/{size}: {t.tolist()} {kind} {done} {status} {tuple(y.shape)} {backends}")


if __name__ == "__main__":
    main()
