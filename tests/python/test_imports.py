# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""No import circles (issue 54, NOTE [no import circles] in python/fastcomms/ulysses.py): the
graph of the imports python/fastcomms' modules run when they are imported (module level, class
bodies and if/try blocks; not function bodies, not ``if TYPE_CHECKING:``) has no cycle; every
public module imports as the first import of a fresh process; and a module whose import failed
after it registered an opaque class imports on a retry in the same process."""

from __future__ import annotations

import ast
import concurrent.futures
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "python", "fastcomms")
EXTENSIONS = {"fastcomms._C", "fastcomms._built"}  # built, not in the tree


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _at_import(tree: ast.Module):
    """The import statements that run when the module is imported."""
    stack = list(tree.body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            stack.extend(n.orelse)
            continue
        if isinstance(n, ast.Import | ast.ImportFrom):
            yield n
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(n, field, None) or [])


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules its import runs. ``from . import name`` names the submodule
    where there is one, else the package (whose attribute it reads); the implicit import of a
    parent package is Python's own order, not an edge."""
    known = set(modules) | EXTENSIONS
    graph = {}
    for mod, path in modules.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        deps = set()
        for n in _at_import(ast.parse(open(path).read(), path)):
            if isinstance(n, ast.Import):
                deps.update(a.name for a in n.names if a.name.split(".")[0] == "fastcomms")
                continue
            if n.level:
                base = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            if target.split(".")[0] != "fastcomms":
                continue
            for a in n.names:
                sub = f"{target}.{a.name}"
                deps.add(sub if sub in known else target)
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = import_graph(_modules())
    assert graph["fastcomms.sequence_parallel"] >= {
        "fastcomms._ulysses",
        "fastcomms.ring",
    }  # it sees
    found = cycles(graph)
    assert not found, "import circles (module -> what it imports of the circle):\n" + "\n".join(
        f"  {m} -> {sorted(graph[m] & set(c))}" for c in found for m in c
    )


def test_the_check_finds_a_circle():
    """The armed control: the re-export that made the circle (the module sequence_parallel builds
    on importing sequence_parallel at its bottom, as ulysses did before the face) is found."""
    graph = import_graph(_modules())
    graph["fastcomms._ulysses"] = graph["fastcomms._ulysses"] | {"fastcomms.sequence_parallel"}
    assert ["fastcomms._ulysses", "fastcomms.sequence_parallel"] in cycles(graph)


PUBLIC = sorted(
    m for m in _modules() if not any(p.startswith("_") for p in m.split("."))
)  # fastcomms, cli, device_mesh, distwrap, functional, hooks, objcol, ring, sequence_parallel, ...


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@pytest.fixture(scope="module")
def first_imports():
    """Each public module as the first import of a fresh process, two at a time."""
    code = (
        "import importlib, sys; m = importlib.import_module(sys.argv[1]); "
        "[getattr(m, n) for n in getattr(m, '__all__', ())]"
    )

    def run(mod):
        return subprocess.run(
            [sys.executable, "-c", code, mod],
            capture_output=True,
            text=True,
            timeout=180,
            env=_env(),
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {m: pool.submit(run, m) for m in PUBLIC}
        return {m: f.result() for m, f in futures.items()}


@pytest.mark.parametrize("module", PUBLIC)
def test_public_module_imports_first_in_a_fresh_process(first_imports, module):
    """Also reads every name of its __all__ (a name served on first access must resolve)."""
    r = first_imports[module]
    assert r.returncode == 0, f"import {module} first: {(r.stdout + r.stderr)[-4000:]}"


def test_failed_import_leaves_nothing_that_breaks_a_retry():
    """fastcomms.ulysses fails after registering UlyssesGroup as an opaque class (injected); the
    retry in the same process imports it, and its new UlyssesGroup is registered. Before NOTE
    [opaque registration on a retried import] the retry raised 'already registered'."""
    code = """
import fastcomms
from fastcomms import _torch_compat as tc
real = tc.register_symbolic_class
def register_then_fail(cls, members):
    real(cls, members)
    raise ImportError("injected after registering " + cls.__name__)
tc.register_symbolic_class = register_then_fail
try:
    import fastcomms.ulysses
except ImportError as e:
    assert "injected" in str(e), e
else:
    raise SystemExit("the injected failure did not happen")
tc.register_symbolic_class = real
import fastcomms.ulysses as u
from fastcomms.sequence_parallel import SequenceParallelGroup
assert u.SequenceParallelGroup is SequenceParallelGroup
api = tc._opaque_api()
assert api is not None and api[1](u.UlyssesGroup), "the retried class is not registered"
assert tc.opaque_type_name(u.UlyssesGroup) == "fastcomms.ulysses.UlyssesGroup"
print("retry ok")
"""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=_env()
    )
    assert r.returncode == 0 and "retry ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
