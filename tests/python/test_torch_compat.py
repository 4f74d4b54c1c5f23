# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Every torch from 2.11 to the newest (issue 51, item 8): the extension refuses a torch it was not
built against by naming both versions (NOTE [one torch per build]); a build asks for the torch
already installed and pins its minor (tools/build/torch_requirement.py); the private torch APIs
behind fastcomms._torch_compat answer on the installed torch without a deprecation warning
(NOTE [private torch APIs]). CI runs this file on the oldest and on the newest supported torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import fastcomms
import pytest
import torch
from fastcomms import _native, _torch_compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _minor(v: str) -> tuple[int, int]:
    return _native._minor(v)


def test_built_against_the_running_torch():
    from fastcomms import _built

    assert _minor(_built.TORCH_VERSION) == _minor(torch.__version__), (
        _built.TORCH_VERSION,
        torch.__version__,
    )


def test_another_torch_is_refused_naming_both(monkeypatch):
    from fastcomms import _built

    other = f"{_minor(torch.__version__)[0]}.{_minor(torch.__version__)[1] - 1}.0"
    monkeypatch.setattr(_built, "TORCH_VERSION", other)
    with pytest.raises(ImportError) as e:
        _native.check_torch()
    assert other in str(e.value) and torch.__version__ in str(e.value), str(e.value)
    monkeypatch.setattr(_built, "TORCH_VERSION", torch.__version__ + "+local")
    _native.check_torch()  # a local label or another patch release of the same minor is fine


def test_import_refuses_before_loading_the_extension(tmp_path):
    """A fresh process whose package sees a _built.py of another torch: import fails with the
    versions named, not an undefined symbol."""
    pkg = tmp_path / "fastcomms"
    pkg.mkdir()
    (pkg / "_built.py").write_text('TORCH_VERSION = "2.10.0"\n')
    path = os.pathsep.join([str(tmp_path), *sys.path])
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run(
        [sys.executable, "-c", "import fastcomms"], capture_output=True, text=True, env=env
    )
    assert r.returncode != 0
    assert "built against torch 2.10.0" in r.stderr and torch.__version__ in r.stderr, r.stderr
    assert "undefined symbol" not in r.stderr


def _requirement_module():
    spec = importlib.util.spec_from_file_location(
        "torch_requirement", os.path.join(ROOT, "tools", "build", "torch_requirement.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_asks_for_the_installed_torch_and_pins_its_minor(monkeypatch):
    req = _requirement_module()
    monkeypatch.delenv("FASTCOMMS_BUILD_TORCH", raising=False)
    installed = req.installed_torch()
    assert installed is not None and _minor(installed) == _minor(torch.__version__)
    assert req.get_requires_for_dynamic_metadata({}) == [f"torch=={installed.split('+')[0]}"]
    major, minor = _minor(torch.__version__)
    deps = req.dynamic_metadata({}, {})["dependencies"]
    assert f"torch=={major}.{minor}.*" in deps and all(not d.startswith("torch>") for d in deps)
    monkeypatch.setattr(req, "installed_torch", lambda: None)
    assert req.get_requires_for_dynamic_metadata({}) == ["torch>=2.11"]
    monkeypatch.setattr(req, "installed_torch", lambda: "2.10.1+cu126")
    with pytest.raises(RuntimeError, match="torch 2.11 or newer.*torch 2.10.1"):
        req.get_requires_for_dynamic_metadata({})
    monkeypatch.setattr(req, "installed_torch", lambda: "2.13.0+cu128")
    assert req.get_requires_for_dynamic_metadata({}) == ["torch==2.13.0"]


def test_pyproject_pins_no_torch_by_hand():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    build = meta["build-system"]["requires"]
    assert not [r for r in build if r.startswith("torch")], build
    assert "dependencies" in meta["project"]["dynamic"]
    assert "dependencies" not in meta["project"]


def test_import_logs_no_deprecation():
    """torch 2.15 logs a warning for each old name of its opaque-object API; fastcomms uses the
    new ones where torch has them."""
    code = (
        "import logging, warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import fastcomms, fastcomms.ulysses, fastcomms.device_mesh, fastcomms.functional\n"
        "import torch\n"
        "c = fastcomms.new_comm('gloo', torch.device('cpu'), name='w', store=None)\n"
        "c.finalize()\n"
    )
    env = {
        **os.environ,
        "TORCHCOMM_RANK": "0",
        "TORCHCOMM_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29000 + os.getpid() % 1000),
    }
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "deprecated" not in r.stderr.lower(), r.stderr


def test_communicator_and_group_are_opaque_types_of_the_compiler():
    from fastcomms.ulysses import UlyssesGroup
    from torch._library import opaque_object as oo

    registered = getattr(oo, "is_custom_class", None) or oo.is_opaque_type
    assert registered(fastcomms.TorchComm) and registered(UlyssesGroup)
    assert _torch_compat.opaque_type_name(fastcomms.TorchComm).endswith("TorchComm")
    assert issubclass(fastcomms.TorchComm, _torch_compat.OpaqueBase)


def test_flat_mesh_layout_is_torchs_own_flattening():
    """A 2 x 3 mesh flattened through fastcomms' helper has torch's layout for the same
    flattening: one dimension of 6 (torch 2.15 dropped the coalesce/nest spelling)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not torch.distributed.is_available():
        pytest.skip("SKIPPED: torch.distributed is not available in this torch build")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", rank=0, world_size=6, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("a", "b"))
        flat = _torch_compat.flat_mesh_layout(mesh._layout)
        theirs = mesh._flatten("ab")._layout
        assert flat == theirs, (flat, theirs)
        assert len(flat) == 1 and flat.numel() == 6
    finally:
        torch.distributed.destroy_process_group()
