"""The size gates of issue 29, checked on the source: no product file passes 400 lines and no function passes 60.

Product code is every ``.py`` file under ``kvplane/`` and ``backends/`` (test doubles in ``kvplane/testing``
included: they ship). A file or function that grows past its gate fails here naming itself, its size and the
fix: split it along one idea per module, or one step per function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def product_files() -> list[Path]:
    return sorted(p for top in ("kvplane", "backends") for p in (ROOT / top).rglob("*.py")
                  if "build" not in p.relative_to(ROOT).parts)


def test_the_gates_see_the_product_code() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"kvplane/plan/planner.py", "kvplane/flows/disagg/decode/decode_side.py"} <= names
    assert len(names) > 150, len(names)


def test_no_product_file_passes_400_lines() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in product_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, (f"product files over {MAX_FILE_LINES} lines: {long}; split each along one idea per module, "
                      f"with a docstring saying its role")


def test_no_function_passes_60_lines() -> None:
    long = {}
    for p in product_files():
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}; split each into named steps"
