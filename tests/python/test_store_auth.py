# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""NOTE [authenticated rendezvous] (issue 16, item 8): with FASTCOMMS_STORE_TOKEN every value a
communicator reads from its store must carry the shared secret's MAC. Ranks with the same secret
work; a rank with another secret, or without one, is refused on every rank with a clear error
instead of connecting to what it read; a value planted in the store by a process without the
secret is refused."""

import datetime
import os
import traceback

import pytest
import torch
from conftest import spawn


def _ranks(rank, size, path, errq, tokens, expect_ok):
    import fastcomms
    import torch.distributed as dist

    try:
        if tokens[rank] is None:
            os.environ.pop("FASTCOMMS_STORE_TOKEN", None)
        else:
            os.environ["FASTCOMMS_STORE_TOKEN"] = tokens[rank]
        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
        store = dist.FileStore(path, size)
        kw = {"store": store, "timeout": datetime.timedelta(seconds=10)}
        if expect_ok:
            comm = fastcomms.new_comm("gloo", "cpu", "auth", **kw)
            t = torch.full((4,), float(rank + 1))
            comm.all_reduce(t, fastcomms.ReduceOp.SUM, False)
            assert torch.equal(t, torch.full((4,), float(size * (size + 1) // 2)))
            sub = comm.split(list(range(size)), "sub")  # splits are authenticated too
            sub.barrier(False)
            sub.finalize()
            comm.finalize()
        else:
            # world 2: each rank reads the other's word first, so both say why
            with pytest.raises(ValueError, match="FASTCOMMS_STORE_TOKEN"):
                fastcomms.new_comm("gloo", "cpu", "auth", **kw)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_same_secret_works():
    spawn(_ranks, 3, ["s3cret"] * 3, True)


def test_control_no_secret_works():
    spawn(_ranks, 2, [None, None], True)


def test_another_secret_is_refused():
    spawn(_ranks, 2, ["s3cret", "other"], False)


def test_a_rank_without_the_secret_is_refused():
    spawn(_ranks, 2, ["s3cret", None], False)


def _planted(rank, size, path, errq):
    """Rank 0 waits for rank 1's published record, then overwrites it through the raw store (a
    process without the secret): rank 0's read must refuse it."""
    import torch.distributed as dist
    from fastcomms import _C

    try:
        store = dist.FileStore(path, size)
        secret = "s3cret"
        if rank == 1:
            _C._auth_store_set(store, secret, "peer/addr", b"10.0.0.1:1234")
            store.wait(["done"])
        else:
            store.wait(["peer/addr"])
            assert _C._auth_store_get(store, secret, "peer/addr") == b"10.0.0.1:1234"
            store.set("peer/addr", b"6.6.6.6:6666")  # planted without the secret
            with pytest.raises(ValueError, match="refused"):
                _C._auth_store_get(store, secret, "peer/addr")
            # a genuine record copied to another key is refused too
            _C._auth_store_set(store, secret, "a", b"value")
            store.set("b", store.get("a"))
            with pytest.raises(ValueError, match="MAC mismatch"):
                _C._auth_store_get(store, secret, "b")
            store.set("done", b"1")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_planted_and_copied_values_are_refused():
    spawn(_planted, 2)


def _listeners(port):
    """Local addresses listening on `port` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, p = f[1].split(":")
            if f[3] == "0A" and int(p, 16) == port:  # LISTEN
                found.append(addr)
    return found


def _bind_rank(rank, size, path, errq, port, bind, out):
    import fastcomms

    try:
        os.environ.update(
            TORCHCOMM_RANK=str(rank),
            TORCHCOMM_SIZE=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        os.environ.pop("FASTCOMMS_STORE_TOKEN", None)
        if bind is None:
            os.environ.pop("FASTCOMMS_STORE_BIND", None)
        else:
            os.environ["FASTCOMMS_STORE_BIND"] = bind
        comm = fastcomms.new_comm("gloo", "cpu", "bind", timeout=datetime.timedelta(seconds=20))
        if rank == 0:
            with open(out, "w") as f:
                f.write(",".join(_listeners(port)))
        comm.barrier(False)  # rank 0's store lives until every rank is past this
        comm.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("bind", [None, "*"])
def test_default_store_listens_on_master_addr_only(tmp_path, bind):
    """Issue 16, item 8: the TCPStore new_comm starts without a store listens on MASTER_ADDR's
    address (here the loopback), not on every interface; FASTCOMMS_STORE_BIND='*' is the armed
    control (torch's own bind: every interface), which must show up as such."""
    from conftest import free_port

    port = free_port()
    out = str(tmp_path / "listen")
    spawn(_bind_rank, 2, port, bind, out)
    listen = open(out).read().split(",")
    loopback = "0100007F"  # 127.0.0.1 in /proc/net/tcp
    if bind is None:
        assert listen == [loopback], listen
    else:
        assert any(a.strip("0") == "" for a in listen), listen  # 0.0.0.0 or ::
