# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""No import circles at all (issue 54, NOTE [no import circles] in python/fastcomms/ulysses.py):
the graph of every import python/fastcomms' modules make, at import time and inside functions
(``import``, ``from ... import``, ``importlib.import_module`` of a package module; not ``if
TYPE_CHECKING:``), has no cycle. A deferred import inside a function that says why on its line
(``# deferred: <why>``) is left out of the graph (an import-time import never is);
test_imports.py imports every public module in a fresh process. Also: what other modules attach to a
communicator is held by it and let go by finalize() and abort() (NOTE [communicator
attachments])."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "python", "fastcomms")
EXTENSIONS = {"fastcomms._C", "fastcomms._built"}  # built, not in the tree
DEFERRED = re.compile(r"#\s*deferred:\s*\S")


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imports(tree: ast.Module):
    """(node, in_function) for every import statement and importlib.import_module call."""
    stack = [(n, False) for n in tree.body]
    while stack:
        n, in_fn = stack.pop()
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            stack.extend((c, in_fn) for c in n.orelse)
            continue
        if isinstance(n, ast.Import | ast.ImportFrom):
            yield n, in_fn
            continue
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module"):
            yield n, in_fn
        inner = in_fn or isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack.extend((c, inner) for c in ast.iter_child_nodes(n))


def _targets(node, mod: str, package: str, known: set[str]) -> set[str]:
    """The package modules an import names (``from . import x`` names the submodule where there
    is one, else the package whose attribute it reads); None for an importlib call whose module
    cannot be read from the code."""
    if isinstance(node, ast.Call):  # importlib.import_module(f"{__package__}.x") or ("fastcomms.x")
        arg = ast.unparse(node.args[0]) if node.args else ""
        m = re.fullmatch(r"""f?['"](?:\{__package__\}|fastcomms)\.(\w+)['"]""", arg)
        if m:
            return {f"fastcomms.{m.group(1)}"}
        return None if "__package__" in arg or "fastcomms" in arg else set()
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "fastcomms"}
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "fastcomms":
        return set()
    return {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}


def import_graph(modules: dict[str, str]):
    """module -> the package modules it imports; the deferred imports left out; the importlib
    calls whose target the code does not spell and that do not say they are deferred."""
    known = set(modules) | EXTENSIONS
    graph, deferred, unread = {}, [], []
    for mod, path in modules.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        lines = open(path).read().splitlines()
        deps = set()
        for node, in_fn in _imports(ast.parse("\n".join(lines), path)):
            text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            targets = _targets(node, mod, package, known)
            if in_fn and DEFERRED.search(text):
                names = sorted(targets) if targets is not None else ["(a computed module)"]
                deferred.extend(f"{mod} -> {t} (line {node.lineno})" for t in names)
                continue
            if targets is None:
                unread.append(f"{mod} line {node.lineno}: {text.strip()}")
                continue
            deps |= targets
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph, deferred, unread


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


def _path(graph, comp):
    """One cycle through the component, for the message."""
    start, seen, path = comp[0], {comp[0]}, [comp[0]]
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in comp)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return " -> ".join([*path, start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return " -> ".join([*path, nxt[0]])
        seen.add(fresh[0])
        path.append(fresh[0])


def test_no_import_circles_anywhere():
    graph, deferred, unread = import_graph(_modules())
    assert not unread, f"imports of a computed module that do not say they are deferred: {unread}"
    found = cycles(graph)
    circles = "\n".join(_path(graph, c) for c in found)
    assert not found, f"import circles (deferred imports left out: {deferred}):\n{circles}"


def test_the_checker_sees_function_imports_and_importlib(tmp_path):
    """The checker is not blind: a circle closed inside a function, or by importlib, is found;
    one marked deferred is not."""
    pkg = tmp_path / "fastcomms"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .b import x\n")
    (pkg / "b.py").write_text("from . import a\nx = 1\n")
    (pkg / "c.py").write_text(
        "import importlib\n\ndef g():\n    importlib.import_module(f'{__package__}.d')\n"
    )
    (pkg / "d.py").write_text("from .c import g\n")
    (pkg / "e.py").write_text("def h():\n    from . import f  # deferred: for the test\n")
    (pkg / "f.py").write_text("from . import e\n")
    (pkg / "g.py").write_text(
        "import importlib\n\ndef k(n):\n    importlib.import_module(f'{__package__}.{n}')\n"
    )
    mods = {
        f"fastcomms.{p.stem}" if p.stem != "__init__" else "fastcomms": str(p)
        for p in pkg.iterdir()
    }
    graph, deferred, unread = import_graph(mods)
    assert sorted(cycles(graph)) == [["fastcomms.a", "fastcomms.b"], ["fastcomms.c", "fastcomms.d"]]
    assert deferred == ["fastcomms.e -> fastcomms.f (line 2)"]
    assert unread == ["fastcomms.g line 4: importlib.import_module(f'{__package__}.{n}')"]


# -- NOTE [communicator attachments] ------------------------------------------------------------
@pytest.fixture
def comm(tmp_path, monkeypatch):
    import fastcomms
    import torch.distributed as dist

    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    return fastcomms.new_comm("gloo", "cpu", "attach", store=store)


class _Thing:
    def __init__(self, comm):
        self.comm, self.destroyed = comm, 0

    def destroy(self):
        self.destroyed += 1


@pytest.mark.parametrize("end", ["finalize", "abort"])
def test_attachments_go_with_the_communicator(comm, end, monkeypatch):
    import fastcomms.functional  # noqa: F401  (registers its attachment)
    import fastcomms.ulysses  # noqa: F401
    from fastcomms import _comm

    monkeypatch.setitem(_comm.ATTACHMENTS, "test", _Thing)
    thing = comm._attachment("test")
    assert comm._attachment("test") is thing and thing.comm is comm  # made once
    group = comm._ulysses_group
    assert group is comm._ulysses_group and group.group is comm
    name = comm._process_group_name
    assert name == comm._process_group_name and name.startswith("fastcomms/functional/")
    assert set(comm._attached) == {"test", "ulysses", "process_group_name"}
    getattr(comm, end)()
    assert comm._attached == {}  # nothing keyed by the communicator outlives it
    # finalize destroys (collective, as finalize is); abort lets go without a call
    assert thing.destroyed == (end == "finalize")
    assert (group.transport == "destroyed") == (end == "finalize")
    if end == "abort":
        comm.finalize()


def test_an_unregistered_attachment_says_so(comm):
    with pytest.raises(RuntimeError, match="no module registered a communicator's 'nothing'"):
        comm._attachment("nothing")
    comm.finalize()
