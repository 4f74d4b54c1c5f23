# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""How a process finds its rank, its world and the store it meets the others on, when
``new_comm`` is given no store.

NOTE [launchers]: docs/launching.md has the table (launcher, the variables of rank and size, the
store). The first launcher whose variables are all present wins, so a launcher started inside
another (torchrun under ``srun``) is itself. Where torch.distributed's default group already
exists with the same rank and size, its store is used (torch's rank 0 holds MASTER_PORT). Where
fastcomms serves the store itself it binds MASTER_ADDR's address only (NOTE [store bind
address]) and shares the port with torch's own TCPStore in the same process (multi-tenant), so
``init_process_group`` may come before or after ``new_comm``.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import datetime
import functools
import os
import re
import sys
import threading
import time
import weakref

# (rank, size) that new_comm takes instead of the environment's, for groups torch makes through
# fastcomms (torch's torchcomms switch, fastcomms as a torch.distributed backend)
rank_size_override: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "fastcomms_rank_size", default=None
)

DEFAULT_PORT = 29500
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


class LaunchError(ValueError):
    """The environment does not say enough (or says contradicting things) to start a rank."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the environment says about this process: who started it and where its store is."""

    launcher: str  # torch group, torchcomms, torchrun, env, slurm, openmpi
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    addr: str
    port: int
    agent_store: bool  # the launcher serves the store; every rank joins it as a client
    source: str  # the variables rank and size were read from
    where: str  # where MASTER_ADDR / MASTER_PORT came from

    def describe(self) -> str:
        local = "" if self.local_rank is None else f", local rank {self.local_rank}"
        local += "" if self.local_size is None else f" of {self.local_size}"
        at = f"{self.addr}:{self.port}"
        store = f"{'serves' if self.rank == 0 else 'joins'} the store at {at} ({self.where})"
        if self.agent_store:
            store = f"joins the launcher's store at {at}"
        who = f"{self.launcher}: rank {self.rank} of {self.size}{local}"
        return f"{who} (from {self.source}); {store}"


def _int(name: str) -> int:
    v = os.environ[name]
    try:
        return int(v)
    except ValueError:
        raise LaunchError(f"new_comm: {name} must be an integer, got {v!r}") from None


def _opt_int(name: str | None) -> int | None:
    return _int(name) if name and name in os.environ else None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist)
    if not m or not m.group(1):
        raise LaunchError(f"new_comm: cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def _addr_port(launcher: str, local_size: int | None, size: int) -> tuple[str, int, str]:
    addr = os.environ.get("MASTER_ADDR")
    where = "MASTER_ADDR"
    if addr is None:
        if launcher == "slurm":
            nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
            if not nodes:
                raise LaunchError(
                    "new_comm: under SLURM without MASTER_ADDR the store's host is the first of "
                    "SLURM_JOB_NODELIST, which is not set"
                )
            addr, where = first_host(nodes), "the first host of SLURM_JOB_NODELIST"
        elif launcher == "openmpi" and local_size is not None and local_size != size:
            raise LaunchError(
                f"new_comm: Open MPI started {size} ranks on several hosts "
                f"(OMPI_COMM_WORLD_LOCAL_SIZE={local_size}); set MASTER_ADDR to rank 0's host "
                "(mpirun -x MASTER_ADDR=<host>)"
            )
        else:
            addr, where = "127.0.0.1", "127.0.0.1: MASTER_ADDR unset"
    if "MASTER_PORT" in os.environ:
        port, pwhere = _int("MASTER_PORT"), "MASTER_PORT"
    elif launcher == "slurm" and "SLURM_JOB_ID" in os.environ:
        port = SLURM_PORT_BASE + _int("SLURM_JOB_ID") % SLURM_PORT_SPAN
        pwhere = "20000 + SLURM_JOB_ID % 20000: MASTER_PORT unset"
    else:
        port, pwhere = DEFAULT_PORT, f"{DEFAULT_PORT}: MASTER_PORT unset"
    if not 0 < port < 65536:
        hint = ""
        if port == 0 and launcher in ("torchrun", "torchcomms"):
            hint = "; torchrun --master-port 0 passes 0 on: give it a port or use --standalone"
        raise LaunchError(
            f"new_comm: the store's port must be in [1, 65535], got {port} ({pwhere}){hint}"
        )
    return addr, port, f"{where}; port {pwhere}"


# the launchers named by variables, in NOTE [launchers]' order: rank, size, local rank, local size
_ENV_LAUNCHERS = {
    "torchcomms": ("TORCHCOMM_RANK", "TORCHCOMM_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    "openmpi": tuple(f"OMPI_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")),
}


def detect() -> Launch | None:
    """The launcher this process runs under (NOTE [launchers]); None when nothing says."""
    given = rank_size_override.get()
    env = os.environ
    torchrun = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_USE_AGENT_STORE" in env
    if given is not None:
        launcher, (rank, size), source = "torch group", given, "the group torch is making"
        local_rank = local_size = None
    else:
        launcher = next((k for k, v in _ENV_LAUNCHERS.items() if v[0] in env and v[1] in env), "")
        if not launcher:
            return None
        rank_var, size_var, local_rank_var, local_size_var = _ENV_LAUNCHERS[launcher]
        source = f"{rank_var}/{size_var}"
        if launcher == "env" and torchrun:
            launcher, source = "torchrun", f"{source} (torchrun)"
        rank, size = _int(rank_var), _int(size_var)
        local_rank, local_size = _opt_int(local_rank_var), _opt_int(local_size_var)
    if size < 1 or not 0 <= rank < size:
        raise LaunchError(
            f"new_comm: rank {rank} and size {size} from {source} do not fit "
            "(size >= 1 and 0 <= rank < size)"
        )
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    agent = agent and launcher in ("torchrun", "torchcomms")
    addr, port, where = _addr_port(launcher, local_size, size)
    return Launch(launcher, rank, size, local_rank, local_size, addr, port, agent, source, where)


def required(op: str = "new_comm") -> Launch:
    launch = detect()
    if launch is None:
        raise LaunchError(
            f"{op}: no store was given and no launcher is recognized: start the ranks with "
            "torchrun, srun or mpirun, set RANK/WORLD_SIZE (or TORCHCOMM_RANK/TORCHCOMM_SIZE) "
            "with MASTER_ADDR/MASTER_PORT, or pass store="
        )
    return launch


# -- the store --------------------------------------------------------------------------------
def _listen_on(addr: str, port: int, rank: int, size: int):
    """NOTE [store bind address]: rank 0's listening socket for torch's TCPStore
    (``master_listen_fd``, which then owns it), bound to MASTER_ADDR's address, not every interface
    (torch's own behaviour, FASTCOMMS_STORE_BIND="*"; another address overrides MASTER_ADDR's)."""
    import socket

    bind = os.environ.get("FASTCOMMS_STORE_BIND", addr)
    if bind in ("*", "0.0.0.0", "::"):
        return None  # torch binds every interface itself
    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise LaunchError(
            f"[rank {rank}/{size}] new_comm: cannot resolve the store's address {bind!r} "
            f"(MASTER_ADDR or FASTCOMMS_STORE_BIND): {e}"
        ) from e
    err = None
    for family, *_, sockaddr in infos:
        try:  # (SO_REUSEADDR set)
            return socket.create_server(
                sockaddr, family=family, backlog=max(128, 2 * size)
            ).detach()
        except OSError as e:
            err = e
    hint = (
        "; torchrun's agent serves a store there: is TORCHELASTIC_USE_AGENT_STORE missing from "
        "this process's environment?"
        if "TORCHELASTIC_RUN_ID" in os.environ
        else ""
    )
    raise LaunchError(
        f"[rank {rank}/{size}] new_comm: rank 0 serves the store on {bind}:{port} "
        f"(MASTER_ADDR, MASTER_PORT) but cannot listen there: {err}; MASTER_ADDR must be an "
        "address of rank 0's host (FASTCOMMS_STORE_BIND=<address> binds another, '*' every "
        f"interface) and MASTER_PORT a port no other process (a second rank 0, another job) "
        f"listens on{hint}"
    )


def _with_deadline(make, what: str, timeout: datetime.timedelta):
    """make() within `timeout` (a helper thread): torch's TCPStore client retried an unreachable
    network for 38 s given 5 s (tests/python/test_multihost.py)."""
    fut = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(make())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            fut.set_exception(e)

    t = threading.Thread(target=run, name="fastcomms-store", daemon=True)
    t.start()
    t.join(timeout.total_seconds() + 1.0)
    if not fut.done():
        raise TimeoutError(f"{what} within {timeout.total_seconds():g} s")
    return fut.result()


def _tcp_store(addr: str, port: int, size: int, rank: int, timeout, agent: bool = False):
    """torch's multi-tenant TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves, unless torchrun)."""
    import torch.distributed as dist

    serve, whose = rank == 0 and not agent, "torchrun's" if agent else "the"
    listen_fd = _listen_on(addr, port, rank, size) if serve else None
    kw = {} if listen_fd is None else {"master_listen_fd": listen_fd}
    kw.update(timeout=timeout, wait_for_workers=False, multi_tenant=True)
    return _with_deadline(
        functools.partial(dist.TCPStore, addr, port, size, serve, **kw),
        f"[rank {rank}/{size}] new_comm: {whose} store at {addr}:{port} (MASTER_ADDR, "
        f"MASTER_PORT) could not be {'served' if serve else 'reached'}",
        timeout,
    )


# NOTE [one store per MASTER_PORT]: every store-less communicator of this process shares the one
# TCPStore at MASTER_ADDR:MASTER_PORT (a second server cannot take the port; each communicator has
# its own key space, NOTE [store incarnations] in core/communicator.cpp), held weakly so the port
# frees once unused. A rank could otherwise reach a server rank 0 is about to close (the
# torchcomms test files did), so rank 0 announces the k-th such communicator (the same k on every
# rank) with the key "fastcomms/default/<k>", and the others take a server only once they see it.
_default_stores: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_default_count: dict[tuple[str, int, int], int] = {}


def _served_store(addr: str, port: int, size: int, rank: int, timeout):
    key = (addr, port, size)
    k = _default_count[key] = _default_count.get(key, 0) + 1
    mark = f"fastcomms/default/{k}"
    store = _default_stores.get(key)
    if rank == 0:
        store = _default_stores[key] = store or _tcp_store(addr, port, size, rank, timeout)
        store.set(mark, "1")
        if k > 1:  # every rank took the store of k - 1 before rank 0 could finish making it
            store.delete_key(f"fastcomms/default/{k - 1}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        if store is None:
            store = _tcp_store(addr, port, size, rank, datetime.timedelta(seconds=max(left, 0.1)))
        try:
            store.wait([mark], datetime.timedelta(seconds=max(min(1.0, left), 0.05)))
            _default_stores[key] = store
            return store
        except Exception as e:  # a server about to close, or not rank 0's current one
            store = None
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"[rank {rank}/{size}] new_comm: rank 0 did not announce its store at "
                    f"{addr}:{port} (MASTER_ADDR, MASTER_PORT) for this communicator within "
                    f"{timeout.total_seconds():g} s: {e}"
                ) from e
            time.sleep(0.05)


_agent_stores: dict[tuple[str, int, str], object] = {}


def _agent_store(launch: Launch, timeout):
    """torchrun's agent store: one client per process (as torch's env:// rendezvous makes), under a
    prefix per restart so that a restarted job never reads the keys of the attempt before it."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = (launch.addr, launch.port, attempt)
    if key not in _agent_stores:
        client = _tcp_store(launch.addr, launch.port, launch.size, launch.rank, timeout, True)
        _agent_stores[key] = dist.PrefixStore(f"fastcomms/attempt_{attempt}", client)
    return _agent_stores[key]


def _torch_default_store(launch: Launch):
    """The store of torch.distributed's default group where it has this rank and size, else None."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not c10d.is_initialized():
        return None
    try:
        if (c10d.get_rank(), c10d.get_world_size()) != (launch.rank, launch.size):
            return None
        store = c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private helper: without it, fall back to MASTER_PORT
        return None
    import torch.distributed as dist

    return dist.PrefixStore("fastcomms", store)


def default_store(launch: Launch, timeout):
    """The store new_comm uses without one (NOTE [launchers])."""
    if launch.agent_store:
        return _agent_store(launch, timeout)
    store = _torch_default_store(launch)
    if store is not None:
        return store
    return _served_store(launch.addr, launch.port, launch.size, launch.rank, timeout)
