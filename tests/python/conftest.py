# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Spawns worlds of real processes: each rank gets a fastcomms gloo communicator and a
torch.distributed gloo process group over one FileStore (two prefixes), so every check can
compare fastcomms with torch.distributed on the same inputs."""

import datetime
import os
import sys
import tempfile
import traceback

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
# Inductor compiles in a pool of worker processes, one per core, started in every process that
# compiles; the ranks of a world each compile, so on a 2-core CI machine 2-3 ranks started 4-6
# more interpreters importing torch. Compiling in the rank's own process gives the same code; set
# the variable to override.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _hang_guard():
    """A rank stuck past FASTCOMMS_TEST_HANG_S (default 150 s) prints every thread's Python stack
    and exits, so a hang shows where it is instead of only timing out."""
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(
        int(os.environ.get("FASTCOMMS_TEST_HANG_S", "150")), exit=True
    )


def meet(store, size):
    """Waits until every rank of `size` got here, under the store's own timeout (a wait for a key
    the last to arrive sets): ranks meet before a communicator whose short timeout would also
    bound its rendezvous, so a rank that starts late on a loaded machine does not fail it."""
    if store.add("started", 1) == size:
        store.set("started/all", "1")
    store.wait(["started/all"])


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank, size, path, backend="gloo", **kwargs):
    """What every spawned rank does first: the TORCHCOMM_* variables, the FileStore at `path`, and
    torch.distributed's default group on it under the prefix "torch". Returns the store."""
    import torch.distributed as dist

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    store = dist.FileStore(path, size)
    dist.init_process_group(
        backend, store=dist.PrefixStore("torch", store), rank=rank, world_size=size, **kwargs
    )
    return store


def gpu_rank(rank, size, path, backend, name, timeout_s=60, **comm_kwargs):
    """What a GPU test's rank does first: cuda:rank as its device, torch.distributed's NCCL
    default group (init_rank), and a fastcomms communicator of ``backend`` on the same store
    under the prefix "fc" (comm_kwargs added to new_comm's arguments). Returns (device, comm)."""
    import fastcomms
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = init_rank(rank, size, path, "nccl", device_id=dev)
    comm = fastcomms.new_comm(
        backend,
        dev,
        name,
        store=dist.PrefixStore("fc", store),
        timeout=datetime.timedelta(seconds=timeout_s),
        **comm_kwargs,
    )
    return dev, comm


# Ranks start from a fork server that imported torch once (multiprocessing's "forkserver" start,
# as torch's DataLoader forks workers after importing torch): a spawned interpreter spends about
# 2 s of CPU importing torch, which on a 2-core CI machine was most of a small test's time. The
# server starts fresh (no CUDA, no communicator, no thread of ours) at the first spawn; what it
# does not preload, each rank imports itself.
_PRELOAD = ["torch", "torch.distributed", "pytest"]


def _rank_main(env, target, *args):
    # the fork server's environment is the one it started with: each rank gets the test's own,
    # as a spawned process would (monkeypatched and MPS variables included), before it imports
    # fastcomms or touches CUDA
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def rank_context():
    """The multiprocessing context ranks start from (the fork server above)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def rank_process(ctx, target, args):
    """ctx.Process(target=target, args=args) started as spawn() starts its ranks: with the
    caller's environment."""
    return ctx.Process(target=_rank_main, args=(dict(os.environ), target, *args))


def spawn(target, size, *args, timeout=180):
    """Runs target(rank, size, store_path, errq, *args) on `size` processes sharing one FileStore
    path, forked from a server that preloaded torch (each with the caller's environment); a rank
    reports its traceback through errq. Fails with every rank's traceback and exit code if any
    rank fails or outlives `timeout` seconds (then it is killed)."""
    ctx = rank_context()
    errq = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            rank_process(ctx, target, (r, size, os.path.join(d, "store"), errq, *args))
            for r in range(size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
                p.join()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    codes = [p.exitcode for p in procs]
    if errors or any(c != 0 for c in codes):
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
        pytest.fail(f"exit codes {codes}\n{msg}")


def _worker(rank, world, path, errq, module, fn_name, comm_kwargs):
    _hang_guard()
    import fastcomms
    import torch.distributed as dist

    try:
        store = init_rank(rank, world, path)
        comm = fastcomms.new_comm(
            "gloo",
            "cpu",
            store=dist.PrefixStore("fc", store),
            **{"name": "t", "timeout": datetime.timedelta(seconds=60), **comm_kwargs},
        )
        mod = __import__(module)
        getattr(mod, fn_name)(comm, rank, world)
        comm.finalize()
        dist.destroy_process_group()
    except BaseException:  # report every rank's failure to the parent
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.fixture
def world():
    """world(fn, size, **new_comm_kwargs): runs fn(comm, rank, size) on `size` processes, each
    with a fastcomms gloo communicator (new_comm_kwargs added to its arguments) and a
    torch.distributed gloo group; fails with every rank's traceback."""

    def run(fn, size, **comm_kwargs):
        spawn(_worker, size, fn.__module__, fn.__name__, comm_kwargs)

    return run
