"""The shape the code keeps: files that fit in a head, no import cycles (imports
inside functions count), and a router process without torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.helpers import ROOT

PAGODA = os.path.join(ROOT, "pagoda")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """Module name -> file, for every module under pagoda/."""
    out = {}
    for folder, _, files in os.walk(PAGODA):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def _imports(path: str, module: str, modules: dict[str, str]) -> set[str]:
    """The pagoda modules `path` imports anywhere in it (functions included), but
    under `if TYPE_CHECKING:`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {resolve(f"{base}.{a.name}") for a in node.names}
    return {m for m in found if m is not None and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def _num_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def test_no_file_is_longer_than_500_lines():
    long = {
        os.path.relpath(path, ROOT): n
        for path in _modules().values()
        if (n := _num_lines(path)) > MAX_LINES
    }
    assert long == {}


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(path, m, modules) for m, path in modules.items()}
    assert "pagoda.core.scheduler" in graph["pagoda.engine.llm_engine"]  # the scan sees edges
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_router_process_imports_no_torch():
    code = (
        "import sys\n"
        "from pagoda.entrypoints import cli\n"
        "from pagoda.entrypoints.router import Router, RouterConfig, build_app\n"
        "from pagoda.entrypoints.router.tokens import PromptTokenizer\n"
        "tok = PromptTokenizer.load(None)\n"  # the default model's GGUF vocabulary
        "assert tok is not None and tok.encode('hello world')\n"
        "r = Router(RouterConfig(backends=('http://a',)), tok)\n"
        "assert r.block_hashes({'messages': [{'role': 'user', 'content': 'hi ' * 40}]})\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
