# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Third-party backends are found through the entry-point group ``fastcomms.backends``: an
installed distribution (here a dist-info folder on sys.path) naming ``module:BackendClass``."""

import textwrap

import fastcomms
import pytest


def test_entry_point_backend(tmp_path, monkeypatch):
    name = "epfake"
    (tmp_path / "fc_epfake.py").write_text(
        textwrap.dedent(
            """
            import fastcomms

            class FakeBackend(fastcomms.TorchCommBackend):
                def __init__(self, rank, size, device, options):
                    self.rank, self.size, self.device, self.options = rank, size, device, options

                def get_rank(self):
                    return self.rank
            """
        )
    )
    info = tmp_path / "fc_epfake-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fc-epfake\nVersion: 0.1\n")
    eps = f"[fastcomms.backends]\n{name} = fc_epfake:FakeBackend\n"
    (info / "entry_points.txt").write_text(eps)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    assert not fastcomms.is_backend_built(name)
    comm = fastcomms.new_comm(name, "cpu", store=object(), hints={"k": "v"})
    assert type(comm).__name__ == "FakeBackend" and comm.get_rank() == 0
    assert comm.options.hints == {"k": "v"}
    assert fastcomms.is_backend_built(name) and name in fastcomms.built_backends()
    # a name no distribution provides still fails with the registry's message
    with pytest.raises(ValueError, match="is not built in"):
        fastcomms.new_comm("nosuchbackend", "cpu", store=object())
