# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Two hosts on one machine (issue 17): two network namespaces joined by a veth pair (addresses
in 10.231.0.0/16, traffic only between them), 2 ranks in each (world 4), the store in the first.
Every collective, a split across the namespaces, the Ulysses op (flat, and hierarchical: each
namespace a host), the ring exchange and the 2-D
(ring x ulysses) group with USP attention must be right on every rank;
a rank in a third namespace with no route must fail with a clear timeout. Needs root and
`ip netns` (CI runs as root); skipped, saying why, elsewhere."""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multihost_worker.py")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _netns_usable():
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"fcprobe{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns is not allowed here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


WHY = _netns_usable()


@pytest.fixture
def hosts():
    """Namespaces a and b joined by a veth pair, and c with only a loopback."""
    tag = uuid.uuid4().hex[:6]
    net = 10 + int(tag[:2], 16) % 200  # 10.231.<net>.0/24, fresh per run
    ns = {k: f"fc{k}{tag}" for k in "abc"}
    addr = {"a": f"10.231.{net}.1", "b": f"10.231.{net}.2"}
    try:
        for name in ns.values():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        va, vb = f"va{tag}", f"vb{tag}"
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for side, veth in (("a", va), ("b", vb)):
            _ip("link", "set", veth, "netns", ns[side])
            _ip("-n", ns[side], "addr", "add", f"{addr[side]}/24", "dev", veth)
            _ip("-n", ns[side], "link", "set", veth, "up")
        yield ns, addr
    finally:
        for name in ns.values():
            _ip("netns", "del", name, check=False)


def _start(ns, rank, size, store_addr, port, me, out, timeout_s=30):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        WORKER,
        str(rank),
        str(size),
        store_addr,
        str(port),
        me,
        out,
        str(timeout_s),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.skipif(WHY is not None, reason=str(WHY))
def test_two_namespaces_world_4(hosts, tmp_path):
    ns, addr = hosts
    port = 29000 + int(uuid.uuid4().hex[:3], 16) % 1000
    placement = {0: "a", 1: "b", 2: "a", 3: "b"}  # ranks alternate between the hosts
    procs = {
        r: _start(ns[h], r, 4, addr["a"], port, addr[h], str(tmp_path / f"r{r}.json"))
        for r, h in placement.items()
    }
    outputs = {r: p.communicate(timeout=240)[0] for r, p in procs.items()}
    for r in placement:
        path = tmp_path / f"r{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{outputs[r]}"
        res = json.loads(path.read_text())
        assert res["ok"], (r, res, outputs[r])
        assert len(res["done"]) == 13, res


@pytest.mark.skipif(WHY is not None, reason=str(WHY))
def test_a_rank_without_a_route_times_out_clearly(hosts, tmp_path):
    ns, addr = hosts
    port = 29000 + int(uuid.uuid4().hex[:3], 16) % 1000
    out = tmp_path / "c.json"
    t0 = time.monotonic()
    # rank 1 of 2 in the namespace with no route to the store's host
    p = _start(ns["c"], 1, 2, addr["a"], port, "127.0.0.1", str(out), timeout_s=5)
    text = p.communicate(timeout=240)[0]
    took = time.monotonic() - t0
    res = json.loads(out.read_text())
    assert not res["ok"] and res["done"] == [], (res, text)
    # the store's connect gives up within its 5 s timeout with a message that names the failure
    print(f"no route: {res['error'][:200]} after {res['seconds']:.1f} s")
    assert res["seconds"] <= 5 + 5 and took <= 60, (res, took)
    err = res["error"].lower()
    assert "timeout" in err or "timed out" in err or "unreachable" in err or "connect" in err, res
