"""The test suite's layout, kept: test modules sit in the folders (core, engine, model,
kernels, server, distributed); what they share lives in tests/helpers.py (and the GGUF
writers in tests/gguf_writer.py and tests/gguf_bert_writer.py), imported as `from tests.helpers import ...`; no module
under tests/ imports a test module or conftest.py; conftest.py holds fixtures and hooks
only. Read from the sources (AST), nothing imported."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
SHARED = {
    "helpers",
    "gguf_writer",
    "gguf_bert_writer",
}  # the modules under tests/ others may import
FOLDERS = {"core", "engine", "model", "kernels", "server", "distributed"}


def _sources(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(root: pathlib.Path, path: pathlib.Path, node: ast.AST) -> list[str]:
    """The dotted names an import statement may load (`from m import n`: m and m.n)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    module = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = _dotted(root, path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        base = package[: len(package) - (node.level - 1)]
        module = ".".join(base + ([module] if module else []))
    return [module] + [f"{module}.{a.name}" for a in node.names]


def forbidden_imports(root: pathlib.Path) -> list[str]:
    """'file:line imports target' for every import, anywhere in a module under `root`,
    of a module under `root` other than the shared ones: by its package name
    (tests.core.test_x, tests.conftest) or by its bare name (test_x, conftest), which
    pytest's sys.path insertion would make importable."""
    targets = {}
    for path in _sources(root):
        if path.name == "__init__.py" or path.stem in SHARED:
            continue
        targets[_dotted(root, path)] = path
        targets[path.stem] = path
    found = []
    for path in _sources(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported(root, path, node):
                if name in targets and targets[name] != path:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno} imports {name}")
    return found


def test_no_module_imports_a_test_module_or_conftest():
    assert forbidden_imports(TESTS) == [], "move what is shared into tests/helpers.py"


def test_the_check_finds_each_way_of_importing_a_test_module(tmp_path):
    root = tmp_path / "tests"
    (root / "core").mkdir(parents=True)
    for name in ("__init__.py", "core/__init__.py", "conftest.py", "helpers.py"):
        (root / name).write_text("")
    (root / "core" / "test_a.py").write_text("def shared():\n    pass\n")
    (root / "core" / "test_b.py").write_text(
        "from tests.helpers import x\n"  # allowed
        "from tests.core.test_a import shared\n"
        "from tests.core import test_a\n"
        "import test_a\n"
        "from . import test_a as a\n"
        "from conftest import y\n"
        "def test_b():\n"
        "    from tests.conftest import z\n"
    )
    found = forbidden_imports(root)
    assert [f.split(" imports ")[0] for f in found] == [
        f"tests/core/test_b.py:{n}" for n in (2, 3, 4, 5, 6, 8)
    ]


def test_conftest_holds_fixtures_and_hooks_only():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    others = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr):  # the docstring, pytest.register_assert_rewrite(...)
            continue
        if isinstance(node, ast.FunctionDef):
            fixture = any(
                "fixture" in ast.unparse(d.func if isinstance(d, ast.Call) else d)
                for d in node.decorator_list
            )
            if fixture or node.name.startswith("pytest_"):
                continue
        others.append(f"conftest.py:{node.lineno} {ast.unparse(node).splitlines()[0]}")
    assert others == [], "helpers belong in tests/helpers.py"


def test_test_modules_sit_in_the_folders():
    stray = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if "__pycache__" not in p.parts
        and p != TESTS / "test_layout.py"
        and p.relative_to(TESTS).parts[0] not in FOLDERS
    ]
    assert stray == [], f"test modules go in one of {sorted(FOLDERS)}"
    for folder in FOLDERS:  # packages: every module has one name, tests.<folder>.<module>
        assert (TESTS / folder / "__init__.py").is_file(), folder
