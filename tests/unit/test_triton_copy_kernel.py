"""The cuda backend's Triton copy kernel, bytes compared without a GPU: Triton's interpreter
(``TRITON_INTERPRET=1``) runs it on CPU memory in a child process (``triton_copy_check.py``).

Triton lives outside the venv's path (``make install`` puts it in ``.venv/triton-interp``), so vLLM in the
test process never sees a Triton without a GPU driver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON = Path(sys.prefix) / "triton-interp"
CHECK = Path(__file__).with_name("triton_copy_check.py")


def test_the_triton_copy_kernel_moves_exactly_the_planned_bytes_under_the_interpreter() -> None:
    if not (TRITON / "triton").is_dir():
        pytest.skip(f"no Triton in {TRITON}: `make install` puts it there (pip install --target {TRITON} triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 12, done.stdout + done.stderr[-3000:]
    assert all(line.startswith("ok") for line in lines)
