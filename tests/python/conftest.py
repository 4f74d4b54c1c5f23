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


def _hang_guard():
    """A rank stuck past FASTCOMMS_TEST_HANG_S (default 150 s) prints every thread's Python stack
    and exits, so a hang shows where it is instead of only timing out."""
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(
        int(os.environ.get("FASTCOMMS_TEST_HANG_S", "150")), exit=True
    )


def _worker(rank, world, path, module, fn_name, errq):
    _hang_guard()
    import fastcomms
    import torch.distributed as dist

    try:
        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world)
        store = dist.FileStore(path, world)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=world
        )
        comm = fastcomms.new_comm(
            "gloo",
            "cpu",
            store=dist.PrefixStore("fc", store),
            name="t",
            timeout=datetime.timedelta(seconds=60),
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
    """world(fn, size): runs fn(comm, rank, size) on `size` processes; fails with every rank's
    traceback if any rank fails."""

    def run(fn, size):
        ctx = mp.get_context("spawn")
        errq = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as d:
            procs = [
                ctx.Process(
                    target=_worker,
                    args=(r, size, os.path.join(d, "store"), fn.__module__, fn.__name__, errq),
                )
                for r in range(size)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=180)
                if p.is_alive():
                    p.kill()
        errors = []
        while not errq.empty():
            errors.append(errq.get())
        codes = [p.exitcode for p in procs]
        if errors or any(c != 0 for c in codes):
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
            pytest.fail(f"exit codes {codes}\n{msg}")

    return run
