"""The layers of DESIGN.md, checked on the source: imports point down only, and no product code imports tests.

Walks every module's imports (top level and inside functions) with ``ast``, so a lazy import that reaches up a
layer is caught too. Product code is ``kvplane/`` outside ``kvplane/testing`` and the backend packages
(``backends/*/kvplane_*``); the test suites and the test doubles of ``kvplane.testing`` may import it.
"""

from __future__ import annotations

import ast
import re
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
    # the flows and transports call the recorder: it sits below them and reads them only through what they hand it
    "metrics": ("kvplane.backend", "kvplane.kv", "kvplane.plan", "kvplane.flows", "kvplane.transports",
                "kvplane.integrations", "kvplane.bench", "kvplane.cli"),
    # P/D: the two sides share only wire/ (config, messages, channel, params, loop, mover, local KV); nothing runs
    # between decode/ and prefill/, and wire/ knows neither
    "flows/disagg/decode": ("kvplane.flows.disagg.prefill",),
    "flows/disagg/prefill": ("kvplane.flows.disagg.decode",),
    "flows/disagg/wire": ("kvplane.flows.disagg.decode", "kvplane.flows.disagg.prefill"),
    # the threads that run kvplane's work (executor, job queue) sit at the bottom, beside errors: any layer uses them
    "runtime": ("kvplane.backend", "kvplane.blocks", "kvplane.kv", "kvplane.plan", "kvplane.flows",
                "kvplane.transports", "kvplane.metrics", "kvplane.integrations", "kvplane.proxy", "kvplane.bench",
                "kvplane.cli", "kvplane.collectives", "kvplane.config", "kvplane.descriptors", "kvplane.logs"),
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


TEST_SUPPORT = "kvplane.testing"
# the whole source tree that ships as product code: kvplane/ (the conformance suite included) and backends
PRODUCT = [p for p in [*PACKAGE.rglob("*.py"), *ROOT.glob("backends/*/kvplane_*/**/*.py")]
           if not p.is_relative_to(PACKAGE / "testing")]
# An emulation variable read by the library is a test-mode flag (STYLE.md): none may be named anywhere in it
EMULATION_VARIABLE = re.compile(r"KVPLANE_EMULATE|\bEMULATE_ENV\b")


def test_product_code_never_imports_kvplane_testing() -> None:
    bad = [f"{path.relative_to(ROOT)} imports {module}" for path in sorted(PRODUCT)
           for module in imported_modules(path) if module == TEST_SUPPORT or module.startswith(TEST_SUPPORT + ".")]
    assert not bad, "product code importing test doubles:\n" + "\n".join(bad)


def test_product_code_reads_no_emulation_variable() -> None:
    bad = [str(path.relative_to(ROOT)) for path in sorted(PRODUCT) if EMULATION_VARIABLE.search(path.read_text())]
    assert not bad, f"product code naming an emulation variable: {bad}"


def test_the_walk_sees_the_backend_packages_and_the_cli() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PRODUCT}
    assert {"backends/cuda/kvplane_cuda/backend.py", "kvplane/backend/accelerator.py", "kvplane/cli/conformance.py",
            "kvplane/conformance/plugin.py"} <= names
    assert not any(n.startswith("kvplane/testing/") for n in names)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above_them(package: str) -> None:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


# the ground: single modules every layer may use, importing no kvplane module but errors (descriptors' checks raise
# its types); runtime and metrics, the ground packages, have their rules in FORBIDDEN
GROUND = ("descriptors", "errors", "config", "logs", "hosts", "machines")


@pytest.mark.parametrize("module", GROUND)
def test_ground_modules_import_only_errors(module: str) -> None:
    kvplane_imports = {m for m in imported_modules(PACKAGE / f"{module}.py") if m.startswith("kvplane")}
    assert {m for m in kvplane_imports if not m.startswith("kvplane.errors")} == set(), kvplane_imports
