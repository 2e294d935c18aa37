"""The examples run as documented: the nano-vllm-style offload hooks store a prompt's KV layer by layer, load it
back for a second run of the same prompt, and the second run decodes as the first."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nano_offload_loads_the_stored_prefix_and_decodes_the_same() -> None:
    result = load("nano_offload").run(prompt_len=70)
    assert result["loaded_tokens"] == 64  # four full 16-token blocks; the last 6 tokens are computed again
    assert result["kv_equal"] == 1.0 and result["reported"] == 1.0
    assert result["max_logit_diff"] < 1e-4  # the same math on fewer query rows: equal up to float rounding


def test_nano_offload_runs_as_a_script() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "nano_offload.py")], capture_output=True, text=True,
                          timeout=120, env={"KVPLANE_DEVICE": "cpu", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert "loaded 64 of 70 prompt tokens" in proc.stdout and "KV equal: True" in proc.stdout
