# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Two-dimensional sequence parallelism (USP, API.md §2): a row-major (ring, ulysses) grid, the
Ulysses all-to-all inside each row of consecutive ranks (one node: NVLink), a ring across the rows
(examples/usp_attention.py; docs/sequence_parallel.md)."""

from __future__ import annotations

import torch

from ._comm import TorchComm
from ._ulysses import UlyssesGroup
from ._work import _Scoped
from .ring import RingGroup, zigzag_shard, zigzag_unshard

__all__ = ["SequenceParallelGroup"]


class SequenceParallelGroup(_Scoped):
    """A 2-D sequence-parallel group (collective to construct).

    ``mesh``: a 2-D DeviceMesh with dimensions named ``ring_dim`` and ``ulysses_dim`` (either
    order), or a ``(ring_size, ulysses_size)`` pair, whose grid is built row-major over ``group``:
    a ``TorchComm`` (split into the two dimensions) or None (torch.distributed's default group,
    through ``init_device_mesh`` on ``device``: default "cuda" under NCCL, else "cpu").
    ``sp.ulysses`` is a ``UlyssesGroup`` over the inner dimension, ``sp.ring`` a ``RingGroup``
    over the outer, ``sp.ring_grad`` a second ring for the backward's gradients."""

    def __init__(
        self,
        mesh,
        *,
        ring_dim: str = "ring",
        ulysses_dim: str = "ulysses",
        group=None,
        device=None,
        transport: str = "auto",
    ):
        if ring_dim == ulysses_dim:
            raise ValueError(
                "SequenceParallelGroup: ring_dim and ulysses_dim must differ, both are "
                f"{ring_dim!r}"
            )
        self.mesh = None
        self._ring_grad = None
        if isinstance(mesh, tuple | list):
            ring_comm, ulysses_comm = self._from_sizes(mesh, ring_dim, ulysses_dim, group, device)
        else:
            if group is not None:
                raise ValueError(
                    "SequenceParallelGroup: group= builds the grid from a (ring_size, "
                    "ulysses_size) pair; a DeviceMesh already names its groups"
                )
            _check_mesh(mesh, ring_dim, ulysses_dim)
            ring_comm, ulysses_comm = mesh.get_group(ring_dim), mesh.get_group(ulysses_dim)
        self.ulysses = UlyssesGroup(ulysses_comm, transport=transport)
        self.ring = RingGroup(ring_comm)
        self.ring_size, self.ulysses_size = self.ring.size, self.ulysses._size
        self.ring_rank, self.ulysses_rank = self.ring.rank, self.ulysses._rank
        self.size = self.ring_size * self.ulysses_size
        self.rank = self.ring_rank * self.ulysses_size + self.ulysses_rank  # row-major grid

    def _from_sizes(self, sizes, ring_dim, ulysses_dim, group, device):
        import torch.distributed as dist

        sizes = tuple(sizes)
        if len(sizes) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes
        ):
            raise ValueError(
                "SequenceParallelGroup: a (ring_size, ulysses_size) pair of ints >= 1, got "
                f"{sizes!r}"
            )
        ring_size, ulysses_size = sizes
        if group is not None and not isinstance(group, TorchComm):
            raise TypeError(
                "SequenceParallelGroup: group= must be a fastcomms TorchComm (or None for "
                f"torch.distributed's default group), got {type(group).__name__}"
            )
        if group is None and not dist.is_initialized():
            raise ValueError(
                "SequenceParallelGroup: no group given and torch.distributed is not "
                "initialized (call init_process_group, or pass group=a TorchComm)"
            )
        world = dist.get_world_size() if group is None else group.get_size()
        if ring_size * ulysses_size != world:
            raise ValueError(
                f"SequenceParallelGroup: ring {ring_size} x ulysses {ulysses_size} = "
                f"{ring_size * ulysses_size} ranks, the group has {world}"
            )
        if group is not None:
            # every rank joins its row (a Ulysses group) and its column (a ring), row-major
            r, u = divmod(group.get_rank(), ulysses_size)
            row = [r * ulysses_size + j for j in range(ulysses_size)]
            column = [i * ulysses_size + u for i in range(ring_size)]
            ulysses_comm = group.split(row, f"{group.get_name()}.{ulysses_dim}")
            return group.split(column, f"{group.get_name()}.{ring_dim}"), ulysses_comm
        from torch.distributed.device_mesh import init_device_mesh

        if device is None:
            nccl = "nccl" in str(dist.get_backend()).lower()
            device = "cuda" if nccl and torch.cuda.is_available() else "cpu"
        self.mesh = init_device_mesh(
            str(device), (ring_size, ulysses_size), mesh_dim_names=(ring_dim, ulysses_dim)
        )
        return self.mesh.get_group(ring_dim), self.mesh.get_group(ulysses_dim)

    @property
    def ring_grad(self) -> RingGroup:
        """A second RingGroup over the ring's ranks for the backward's gradient accumulators (each
        ring has its own double buffer); made on first use, collectively on the window transport."""
        if self._ring_grad is None:
            self._ring_grad = RingGroup(self.ring.group)
        return self._ring_grad

    def check_heads(self, num_heads: int, num_kv_heads: int | None = None) -> int:
        """The ``kv_replicas`` for the K/V all-to-all with ``num_heads`` query heads and
        ``num_kv_heads`` K/V heads (None: as many): 1 when the K/V heads divide by the Ulysses size,
        ``ulysses_size // num_kv_heads`` when they divide it (LoongTrain's KV replication). Raises
        ValueError naming the numbers and a grid that fits otherwise."""
        u = self.ulysses_size
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or kv < 1 or num_heads % kv:
            raise ValueError(
                f"SequenceParallelGroup: {num_heads} query heads and {kv} K/V heads: the query "
                "heads must be a positive multiple of the K/V heads"
            )

        def fits(d):
            return num_heads % d == 0 and (kv % d == 0 or d % kv == 0)

        if fits(u):
            return 1 if kv % u == 0 else u // kv
        # Refused rather than silently wrong: the Ulysses all-to-all hands each rank a whole
        # number of heads; a remainder would drop heads or pair queries with the wrong K/V.
        best = max(d for d in range(1, self.size + 1) if self.size % d == 0 and fits(d))
        what = f"{kv} K/V heads (grouped-query attention)"
        if num_heads % u:
            what = f"{num_heads} query heads"
        raise ValueError(
            f"SequenceParallelGroup: {what} do not split over the Ulysses size {u} "
            f"(ring {self.ring_size} x ulysses {u} = {self.size} ranks): each Ulysses rank needs "
            f"a whole number of query heads ({num_heads} % {u} must be 0) and of K/V heads "
            f"({kv} % {u} must be 0, or {u} % {kv} for K/V heads replicated over ranks). "
            f"Take a larger ring size: ring {self.size // best} x ulysses {best} fits "
            f"{num_heads} / {kv} heads on {self.size} ranks"
        )

    def shard(self, x: torch.Tensor, *, dim: int = 1, zigzag: bool = False) -> torch.Tensor:
        """This rank's part of the whole sequence ``x`` along ``dim``: the ring shard (zig-zag for
        causal attention), cut into ``ulysses_size`` pieces, piece ``ulysses_rank``."""
        n = x.shape[dim]
        parts = 2 * self.ring_size if zigzag else self.ring_size
        if n % (parts * self.ulysses_size):
            raise ValueError(
                f"SequenceParallelGroup.shard: the sequence ({n}) must divide into "
                f"{parts} ring chunks x {self.ulysses_size} Ulysses pieces"
            )
        if zigzag:
            ring_part = zigzag_shard(x, self.ring_size, self.ring_rank, dim)
        else:
            ring_part = x.chunk(self.ring_size, dim=dim)[self.ring_rank]
        return ring_part.chunk(self.ulysses_size, dim=dim)[self.ulysses_rank].contiguous()

    def unshard(self, parts, *, dim: int = 1, zigzag: bool = False) -> torch.Tensor:
        """The whole sequence from every rank's ``shard`` (``parts[r]``: grid rank r's)."""
        if len(parts) != self.size:
            raise ValueError(
                f"SequenceParallelGroup.unshard: {len(parts)} parts for {self.size} ranks"
            )
        u = self.ulysses_size
        rings = [torch.cat(parts[i * u : (i + 1) * u], dim=dim) for i in range(self.ring_size)]
        return zigzag_unshard(rings, dim) if zigzag else torch.cat(rings, dim=dim)

    def destroy(self) -> None:
        """Releases both groups' buffers and windows (collective)."""
        for g in (self._ring_grad, self.ring, self.ulysses):
            if g is not None:
                g.destroy()


def _check_mesh(mesh, ring_dim, ulysses_dim):
    if not (hasattr(mesh, "get_group") and hasattr(mesh, "mesh_dim_names")):
        raise TypeError(
            "SequenceParallelGroup: mesh must be a 2-D DeviceMesh or a (ring_size, "
            f"ulysses_size) pair, got {type(mesh).__name__}"
        )
    if mesh.ndim != 2:
        raise ValueError(
            f"SequenceParallelGroup: the DeviceMesh must be 2-D (ring x ulysses), got "
            f"{mesh.ndim} dimensions {tuple(mesh.mesh.shape)}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    for what, name in (("ring_dim", ring_dim), ("ulysses_dim", ulysses_dim)):
        if name not in names:
            raise ValueError(
                f"SequenceParallelGroup: {what}={name!r} is not a dimension of the mesh "
                f"(its dimensions: {names or 'unnamed'}); name them with "
                "init_device_mesh(..., mesh_dim_names=(ring, ulysses)) or pass ring_dim= "
                "and ulysses_dim="
            )
