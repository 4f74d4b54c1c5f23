# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Third-party backends are found through the entry-point groups ``fastcomms.backends`` and
``torchcomms.backends``: an installed distribution (here a dist-info folder on sys.path) naming
``module:BackendClass``, made and set up with torchcomms' protocol (``cls()``, then ``init``)."""

import textwrap

import fastcomms
import pytest
import torch
import torch.distributed


def test_entry_point_backend(tmp_path, monkeypatch):
    name = "epfake"
    (tmp_path / "fc_epfake.py").write_text(
        textwrap.dedent(
            """
            import fastcomms

            class FakeBackend(fastcomms.TorchCommBackend):
                def init(self, device, name, options):
                    self.device, self.name, self.options = device, name, options

                def get_rank(self):
                    return 0

                def get_size(self):
                    return 1

                def all_reduce(self, tensor, op, async_op):
                    tensor.mul_(2)  # a recognisable effect
                    return None
            """
        )
    )
    info = tmp_path / "fc_epfake-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fc-epfake\nVersion: 0.1\n")
    eps = f"[torchcomms.backends]\n{name} = fc_epfake:FakeBackend\n"  # torchcomms' group
    (info / "entry_points.txt").write_text(eps)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    assert not fastcomms.is_backend_built(name)
    store = torch.distributed.HashStore()
    comm = fastcomms.new_comm(name, "cpu", "ep", store=store, hints={"k": "v"})
    assert isinstance(comm, fastcomms.TorchComm) and comm.get_rank() == 0
    assert comm.get_name() == "ep" and comm.get_options().hints == {"k": "v"}
    t = torch.ones(3)
    comm.all_reduce(t, fastcomms.ReduceOp.SUM, False).wait()
    assert t.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(fastcomms.UnsupportedError, match="does not implement broadcast"):
        comm.broadcast(t, 0, False)
    assert fastcomms.is_backend_built(name) and name in fastcomms.built_backends()
    # a name no distribution provides still fails with the registry's message
    with pytest.raises(ValueError, match="is not built in"):
        fastcomms.new_comm("nosuchbackend", "cpu", store=object())


def test_register_backend_follows_torchcomms_protocol():
    calls = []

    class Pending:
        def __init__(self):
            self.done = False

        def wait(self):
            self.done = True
            calls.append("wait")

        def is_completed(self):
            return self.done

    class Loopback(fastcomms.TorchCommBackend):
        def __init__(self):
            super().__init__()
            calls.append("made")

        def init(self, device, name, options):
            calls.append(("init", str(device), name, options.timeout.total_seconds()))

        def get_rank(self):
            return 0

        def get_size(self):
            return 1

        def barrier(self, async_op):
            return Pending() if async_op else None

    fastcomms.register_backend("loopback_t", Loopback)
    comm = fastcomms.new_comm(
        "loopback_t", "cpu", "lb", timeout=__import__("datetime").timedelta(9)
    )
    assert calls == ["made", ("init", "cpu", "lb", 9 * 86400.0)]
    assert comm.get_backend() == "loopback_t" and comm.get_size() == 1
    w = comm.barrier(True)
    assert not w.is_completed()
    w.wait()
    assert w.is_completed() and calls[-1] == "wait"
    comm.barrier(False).wait()
    comm.finalize()


def test_python_backend_split_timeout_and_waited_work():
    """torchcomms' protocol beyond the ops: ``split(ranks, name, options)`` returns the new
    group's backend, ``set_timeout`` reaches the backend, and a work without is_completed is
    complete once waited for."""

    class Token:
        def wait(self):
            pass

    asked = []

    class Splitting(fastcomms.TorchCommBackend):
        def init(self, device, name, options):
            self.name, self.size, self.timeout = name, 1, None

        def get_rank(self):
            return 0

        def get_size(self):
            return self.size

        def set_timeout(self, timeout):
            self.timeout = timeout

        def all_reduce(self, tensor, op, async_op):
            return Token()

        def split(self, ranks, name, options):
            asked.append((list(ranks), name, options.name))
            if 0 not in ranks:
                return None
            sub = Splitting()
            sub.init("cpu", name, options)
            sub.size = len(ranks)
            sub.split_options = options
            return sub

    import datetime

    fastcomms.register_backend("splitting_py", Splitting)
    comm = fastcomms.new_comm("splitting_py", "cpu", "parent")
    comm.set_timeout(datetime.timedelta(milliseconds=1500))
    assert comm.get_backend_impl().timeout == datetime.timedelta(milliseconds=1500)
    work = comm.all_reduce(torch.ones(2), fastcomms.ReduceOp.SUM, True)
    assert not work.is_completed()
    work.wait()
    assert work.is_completed()
    sub = comm.split([0], "child", hints={"a": "b"})
    assert sub.get_name() == "child" and sub.get_size() == 1 and sub.get_rank() == 0
    assert sub.get_backend_impl().split_options.hints == {"a": "b"}
    # a rank that joins none gets the split's name too (given, or the one made for it)
    assert comm.split([], "nobody") is None and comm.split([], "") is None
    assert asked == [
        ([0], "child", "child"),
        ([], "nobody", "nobody"),
        ([], *["parent.split3"] * 2),
    ]
    sub.finalize()
    comm.finalize()
