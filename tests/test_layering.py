"""docs/architecture.md, "Layers": kvserve.core is pure standard library; kvserve.sim adds numpy
at most.

Each check imports the package in a fresh interpreter where the forbidden modules cannot be
imported, and also reads every import statement, so a lazy import inside a function counts.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvserve"

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked by the layering test: ' + name)
sys.meta_path.insert(0, Block())
import {package}
leaked = sorted(m for m in sys.modules if m.split('.')[0] in {blocked!r})
assert not leaked, leaked
print('ok')
"""


@pytest.mark.parametrize(("package", "blocked"), [
    ("kvserve.core", ["torch", "numpy"]),
    ("kvserve.sim", ["torch"]),
])
def test_package_imports_without_forbidden_modules(package, blocked):
    if not (SRC / package.split(".")[1]).exists():
        pytest.skip(f"{package} does not exist yet")
    result = subprocess.run([sys.executable, "-c", BLOCKER.format(package=package,
                                                                  blocked=set(blocked))],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize(("layer", "allowed"), [
    ("core", set()),
    ("sim", {"numpy", "rich"}),
])
def test_every_import_statement_respects_the_layer(layer, allowed):
    files = sorted((SRC / layer).rglob("*.py"))
    if not files:
        pytest.skip(f"kvserve.{layer} does not exist yet")
    for path in files:
        outside = imported_roots(path) - set(sys.stdlib_module_names) - {"kvserve"} - allowed
        assert not outside, f"{path.relative_to(SRC)} imports {sorted(outside)}"


def test_sim_never_imports_upward():
    """The simulator plans without torch: it may use core and the torch-free top-level
    helpers, never the model, the engine or the server (docs/architecture.md, Layers)."""
    allowed = ("kvserve.core", "kvserve.sim", "kvserve.flags", "kvserve.runs",
               "kvserve.cpu_name", "kvserve.ray_tasks")
    for path in sorted((SRC / "sim").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("kvserve."):
                    assert name.startswith(allowed), f"sim/{path.name} imports {name}"


def test_core_never_imports_upward():
    for path in sorted((SRC / "core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("kvserve."):
                assert node.module.startswith("kvserve.core"), \
                    f"{path.name} imports {node.module}"
