# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The docs run (issue 54): every import statement written in README.md and docs/*.md (in a code
block or inline, as `import x` or `from x import y`) is run as the first statement of a fresh
process, and every ```python block runs, each as its own script, in one process per document
(CPU, gloo, world 1: RANK=0, WORLD_SIZE=1, MASTER_ADDR/MASTER_PORT set), blocks in the order the
document gives them. A block that cannot run so (a distributed launch, a GPU, a fragment) carries
``<!-- docs-test: skip (reason) -->`` on the line before its fence; the test reports it as
skipped with that reason (``pytest -rs``), and its import statements still run.
docs/development.md ("The docs test") has the convention."""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [
    "README.md",
    *sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")),
]
PYTHON = {"python", "py", "python3"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^`]*$")
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<what>.*?)\s*-->")
_SKIP = re.compile(r"skip\s*\((?P<reason>.*\S.*)\)")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclasses.dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, where marked

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def parse(doc: str, text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown text (indented ones in lists too, dedented), each with the
    skip reason of a ``<!-- docs-test: skip (reason) -->`` among the comment lines right above its
    fence; and the problems found (a marker that is malformed or marks no python block)."""
    lines = text.splitlines()
    blocks, problems, i = [], [], 0
    marked, inside = set(), set()  # markers a python block claimed; lines inside fences
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        j = i + 1
        while j < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]
        ):
            j += 1
        body = [
            ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]
        ]
        skip, k = None, i - 1
        while k >= 0 and lines[k].strip().startswith("<!--"):  # the comment lines right above
            mark = _MARK.search(lines[k])
            if mark:
                s = _SKIP.fullmatch(mark["what"])
                if s and lang in PYTHON:
                    skip = s["reason"].strip()
                    marked.add(k)
            k -= 1
        blocks.append(Block(doc, i + 1, lang, "\n".join(body) + "\n", skip))
        inside.update(range(i, j + 1))
        i = j + 1
    for k, ln in enumerate(lines):
        mark = _MARK.search(ln)
        if mark and k not in marked and k not in inside:  # (one shown in a block is an example)
            problems.append(
                f"{doc}:{k + 1}: {ln.strip()!r} is not `<!-- docs-test: skip (reason) -->` "
                "right above a ```python fence"
            )
    return blocks, problems


def _imports_of(code: str) -> list[str]:
    """The import statements of a piece of Python, as ast.unparse writes them; a fragment that does
    not parse is read line by line."""
    try:
        trees = [ast.parse(code)]
    except SyntaxError:
        trees = []
        for ln in code.splitlines():
            if re.match(r"\s*(import|from)\s", ln):
                try:
                    trees.append(ast.parse(ln.strip()))
                except SyntaxError:
                    pass
    return [
        ast.unparse(n)
        for t in trees
        for n in ast.walk(t)
        if isinstance(n, ast.Import | ast.ImportFrom) and not getattr(n, "level", 0)
    ]


def _inline_imports(text: str) -> list[str]:
    """`import x` and `from x import y` written inline in the prose (outside fenced blocks)."""
    out, fenced = [], False
    for ln in text.splitlines():
        if _FENCE.match(ln) or (fenced and re.match(r"^[ \t]*(`{3,}|~{3,})\s*$", ln)):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in _INLINE.findall(ln):
            if re.match(r"(import|from)\s", span.strip()):
                out.extend(_imports_of(span.strip()))
    return out


@functools.cache
def _docs():
    """{doc: (blocks, problems, import statements with where each was written)}."""
    out = {}
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        blocks, problems = parse(doc, text)
        imports = [(s, b.where) for b in blocks if b.lang in PYTHON for s in _imports_of(b.code)]
        imports += [(s, f"{doc} (inline)") for s in _inline_imports(text)]
        out[doc] = (blocks, problems, imports)
    return out


def _statements() -> dict[str, list[str]]:
    """Each distinct documented import statement -> where it is written."""
    out: dict[str, list[str]] = {}
    for _, _, imports in _docs().values():
        for stmt, where in imports:
            out.setdefault(stmt, []).append(where)
    return out


def _python_blocks() -> list[Block]:
    return [b for blocks, _, _ in _docs().values() for b in blocks if b.lang in PYTHON]


# One process per document runs its blocks in order, each as a script of its own (a fresh
# namespace, __name__ == "__main__", a fresh MASTER_PORT) and says which it reached.
_DRIVER = r"""
import json, linecache, os, socket, sys, traceback
for b in json.load(sys.stdin):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
    where, code = b["where"], b["code"]
    linecache.cache[where] = (len(code), None, code.splitlines(True), where)
    print(f"[docs-test] start {where}", flush=True)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__", "__file__": where})
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        print(f"[docs-test] failed {where}", flush=True)
        sys.exit(1)
    print(f"[docs-test] ok {where}", flush=True)
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(k, None)
    return env


def _run_import(stmt: str):
    return subprocess.run(
        [sys.executable, "-c", stmt],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
        cwd=ROOT,
    )


def _run_doc(blocks: list[Block]):
    payload = json.dumps([{"where": b.where, "code": b.code} for b in blocks])
    return subprocess.run(
        [sys.executable, "-c", _DRIVER], input=payload, capture_output=True, text=True, timeout=300,
        env=_env(), cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    """Every process of the module, two at a time (the CI machine has two cores): a fresh one per
    documented import statement and one per document with runnable blocks. Started on first use."""
    runnable: dict[str, list[Block]] = {}
    for b in _python_blocks():
        if b.skip is None:
            runnable.setdefault(b.doc, []).append(b)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        docs = {doc: pool.submit(_run_doc, blocks) for doc, blocks in runnable.items()}
        imports = {stmt: pool.submit(_run_import, stmt) for stmt in _statements()}
        return (
            {k: f.result() for k, f in imports.items()},
            {k: f.result() for k, f in docs.items()},
        )


def test_docs_parse():
    """Every marker is a well-formed skip right above a ```python fence, and the docs hold what
    this test runs (a parser that found nothing would pass everything)."""
    problems = [p for _, problems, _ in _docs().values() for p in problems]
    assert not problems, "\n".join(problems)
    assert len(_statements()) >= 5 and len(_python_blocks()) >= 4, (_statements(), _python_blocks())
    assert any(b.skip is None for b in _python_blocks())


@pytest.mark.parametrize("stmt", sorted(_statements()))
def test_documented_import_first_in_fresh_process(runs, stmt):
    r = runs[0][stmt]
    assert r.returncode == 0, (
        f"`{stmt}` (written in {', '.join(_statements()[stmt])}) fails as the first statement of a "
        f"fresh process:\n{(r.stdout + r.stderr)[-4000:]}"
    )


@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: b.where)
def test_python_block_runs(runs, block):
    if block.skip is not None:
        pytest.skip(f"{block.where}: {block.skip}")
    r = runs[1][block.doc]
    out = r.stdout + r.stderr
    if f"[docs-test] ok {block.where}" in r.stdout:
        return
    if f"[docs-test] start {block.where}" not in r.stdout:
        pytest.fail(
            f"{block.where} did not run: an earlier block of {block.doc} failed\n{out[-4000:]}"
        )
    pytest.fail(
        f"{block.where} fails when run on CPU at world 1 (gloo; RANK=0, WORLD_SIZE=1, MASTER_ADDR/"
        "MASTER_PORT set). Fix the doc or the code; a block that needs a launch of several "
        "ranks, a GPU, or is a fragment gets `<!-- docs-test: skip (reason) -->` on the line "
        f"before its fence.\n{out[-6000:]}"
    )


def test_parser_on_sample():
    """The parser itself: indented fences in lists, the marker among the comments above a fence,
    fragments read line by line, inline imports, and a stray marker reported."""
    text = (
        "Prose `import a.b as c` and `from d import e`, not `import` alone.\n\n"
        "<!-- docs-test: skip (a fragment) -->\n<!-- quickstart: x -->\n"
        "```python\nimport f\ny = (\n```\n\n"
        "- item:\n\n  ```python\n  from g import h\n  print(h)\n  ```\n\n"
        "```bash\nimport nothing\n```\n<!-- docs-test: skip (stray) -->\n\n"
        "```markdown\n<!-- docs-test: skip (an example) -->\n```\n"
    )
    blocks, problems = parse("t.md", text)
    assert [(b.line, b.lang, b.skip) for b in blocks] == [
        (5, "python", "a fragment"),
        (12, "python", None),
        (17, "bash", None),
        (22, "markdown", None),
    ]
    assert blocks[1].code == "from g import h\nprint(h)\n"
    assert _imports_of(blocks[0].code) == ["import f"]
    assert _inline_imports(text) == ["import a.b as c", "from d import e"]
    assert len(problems) == 1 and "t.md:20" in problems[0], problems


def test_runner_reports_the_failing_block():
    """The armed control of the runner: a block that raises fails with its place named, and the
    blocks after it are not reported as run."""
    blocks = [
        Block("t.md", n, "python", code, None)
        for n, code in ((1, "x = 1\n"), (5, "raise ValueError('armed')\n"), (9, "pass\n"))
    ]
    r = _run_doc(blocks)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "[docs-test] ok t.md:1" in r.stdout and "[docs-test] failed t.md:5" in r.stdout, r.stdout
    assert "ValueError: armed" in r.stderr and "t.md:9" not in r.stdout, r.stdout + r.stderr
