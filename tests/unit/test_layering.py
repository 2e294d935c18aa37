"""The layers of DESIGN.md, checked on the source: imports point down only.

Walks every module's imports (top level and inside functions) with ``ast``, so a lazy import that reaches up a
layer is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvplane"

# package -> kvplane packages it must never import
FORBIDDEN = {
    "backend": ("kvplane.kv", "kvplane.plan", "kvplane.flows", "kvplane.transports", "kvplane.integrations",
                "kvplane.bench", "kvplane.cli"),
    "transports": ("kvplane.kv", "kvplane.plan", "kvplane.flows", "kvplane.integrations", "kvplane.bench",
                   "kvplane.cli"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above_them(package: str) -> None:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_value_types_module_imports_only_errors() -> None:
    kvplane_imports = {m for m in imported_modules(PACKAGE / "descriptors.py") if m.startswith("kvplane")}
    assert kvplane_imports <= {"kvplane.errors", "kvplane.errors.LayoutError", "kvplane.errors.PlanError"}
