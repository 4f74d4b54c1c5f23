# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One rank of test_torch_switch.py: torch.distributed with its torchcomms switch on, a module
named torchcomms aliasing fastcomms on the path (made by the test). Exits non-zero on a failure."""

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

dist.config.use_torchcomms = True
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=size)

from fastcomms.device_mesh import comm_of  # noqa: E402

world = dist.group.WORLD
comm = comm_of(world)
assert comm is not None, f"the default group is {type(world).__name__}, not fastcomms'"
assert comm.get_backend() == "gloo" and comm.get_size() == size and comm.get_rank() == rank
assert dist.get_rank() == rank and dist.get_world_size() == size

g = torch.Generator().manual_seed(rank)
x = torch.randint(-1000, 1000, (4 * size,), generator=g).float()  # exact sums in any order
t = x.clone()
dist.all_reduce(t)
parts = [torch.empty_like(x) for _ in range(size)]
dist.all_gather(parts, x)
assert torch.equal(t, sum(parts[1:], parts[0].clone())), "all_reduce differs from the gathered sum"
out = [torch.empty(2) for _ in range(size)]
dist.all_to_all(out, [torch.tensor([rank * 100.0 + q, -1.0]) for q in range(size)])
assert all(torch.equal(o, torch.tensor([p * 100.0 + rank, -1.0])) for p, o in enumerate(out)), out
b = x.clone()
dist.broadcast(b, src=size - 1)
assert torch.equal(b, parts[size - 1])
assert torch.equal(funcol.all_reduce(x, "sum", world).wait(), t)

# torch imported fastcomms while it initialized itself (through the alias), before its registry
# of opaque types could be imported: the communicator is registered once one exists, so the
# communicator's methods compile here too (NOTE [compiled communicator methods])
import fastcomms  # noqa: E402
from torch._library import opaque_object  # noqa: E402

_is_registered = getattr(opaque_object, "is_custom_class", None) or opaque_object.is_opaque_type
assert _is_registered(fastcomms.TorchComm), "TorchComm is not an opaque type of torch.compile"


def _step(v):
    comm.all_reduce(v, fastcomms.ReduceOp.SUM, False)
    return v + 0


y = x.clone()
assert torch.equal(torch.compile(_step, fullgraph=True, backend="eager")(y), t) and torch.equal(
    y, t
)

# a group of some of the ranks: its members meet alone, non-members take no part
members = [0, size - 1]
sub = dist.new_group(members)
if rank in members:
    c = comm_of(sub)
    assert c is not None and c.get_size() == 2 and c.get_rank() == members.index(rank)
    s = x.clone()
    dist.all_reduce(s, group=sub)
    assert torch.equal(s, parts[0] + parts[size - 1]), "the subgroup's all_reduce"
    assert dist.get_process_group_ranks(sub) == members
else:
    assert sub == dist.GroupMember.NON_GROUP_MEMBER
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}: ok", flush=True)
