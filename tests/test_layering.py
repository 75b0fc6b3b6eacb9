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


# The torch-free top-level helpers the simulator may use (docs/architecture.md, Layers): they
# import the standard library and kvserve.core, and each other.
HELPERS = ("kvserve.flags", "kvserve.runs", "kvserve.cpu_name", "kvserve.ray_tasks")


@pytest.mark.parametrize(("package", "blocked"), [
    ("kvserve.core", ["torch", "numpy"]),
    ("kvserve.sim", ["torch"]),
    *((helper, ["torch", "numpy"]) for helper in HELPERS),
])
def test_package_imports_without_forbidden_modules(package, blocked):
    result = subprocess.run([sys.executable, "-c", BLOCKER.format(package=package,
                                                                  blocked=set(blocked))],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module ``path`` (or ``source``, as if it were there) names in an import
    statement, absolute: a relative import is resolved against its package, and ``from
    kvserve import x`` names ``kvserve.x``."""
    package = ".".join(("kvserve", *path.relative_to(SRC).parent.parts))
    modules = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base == "kvserve":
                modules.update(f"kvserve.{alias.name}" for alias in node.names)
            else:
                modules.add(base)
    return modules


def test_the_import_reader_sees_relative_and_package_imports():
    """The reader itself: an import written any way is seen (review: a relative import or
    ``from kvserve import model`` passed unseen)."""
    source = ("from kvserve import model\nfrom ..engine import llm\nfrom . import trace\n"
              "import torch.nn\n")
    assert imported_modules(SRC / "sim" / "probe.py", source) == {
        "kvserve.model", "kvserve.engine", "kvserve.sim", "torch.nn"}


def check_layer(files: list[Path], allowed_roots: set[str], allowed_kvserve: tuple[str, ...]
                ) -> None:
    for path in files:
        for name in imported_modules(path):
            root = name.split(".")[0]
            if root == "kvserve":
                assert name.startswith(allowed_kvserve), \
                    f"{path.relative_to(SRC)} imports {name}"
            else:
                assert root in sys.stdlib_module_names or root in allowed_roots, \
                    f"{path.relative_to(SRC)} imports {name}"


def test_core_imports_only_the_standard_library_and_itself():
    check_layer(sorted((SRC / "core").rglob("*.py")), set(), ("kvserve.core",))


def test_sim_never_imports_upward():
    """The simulator plans without torch: it may use core and the torch-free top-level
    helpers, never the model, the engine or the server (docs/architecture.md, Layers)."""
    check_layer(sorted((SRC / "sim").rglob("*.py")), {"numpy", "rich"},
                ("kvserve.core", "kvserve.sim", *HELPERS))


def test_the_top_level_helpers_import_only_the_standard_library_and_core():
    """ray_tasks imports ray inside the functions a Ray worker runs."""
    check_layer([SRC / f"{name.split('.')[1]}.py" for name in HELPERS], {"ray"},
                ("kvserve.core", *HELPERS))
