"""The bench's serve rows in the catalog, without servers: listed only where a serving Python is found, named per
mode and engine, released by one function; `$KVPLANE_SERVE_PYTHON` wins over the checkout's `.venv-serve`, and a
path that is not a file is an error naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.bench import scenarios
from kvplane.bench.serve import command, rows
from kvplane.errors import KvplaneError


def test_the_serve_rows_are_in_the_full_run_only_where_a_serving_python_is_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "serve_python", lambda: Path("/usr/bin/python3"))
    serve = [s for s in scenarios.full() if s.kind == "serve"]
    assert [s.name for s in serve] == [f"serve-pd-{m}-{e}" for e in rows.ENGINES for m in rows.MODES] + [
        "serve-offload-hit", "serve-routing"]
    assert all(s.release is rows.release for s in serve)  # one group: the plain instance is shared
    assert not any(s.kind == "serve" for s in scenarios.default())
    assert [s.name for s in scenarios.select(["serve-offload-hit"], full_run=True)] == ["serve-offload-hit"]
    monkeypatch.setattr(rows, "serve_python", lambda: None)
    assert not any(s.kind == "serve" for s in scenarios.full())


def test_the_serving_python_comes_from_the_environment_first(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv(command.SERVE_PYTHON_ENV, str(python))
    assert command.serve_python() == python
    monkeypatch.setenv(command.SERVE_PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(KvplaneError, match=r"KVPLANE_SERVE_PYTHON=.*missing.* is not a file"):
        command.serve_python()
    monkeypatch.delenv(command.SERVE_PYTHON_ENV)
    monkeypatch.setattr(command, "CHECKOUT_PYTHON", tmp_path / "none")
    assert command.serve_python() is None


def test_the_argv_fills_the_template_and_drops_the_kv_flag_for_a_plain_instance() -> None:
    argv = command.vllm_argv("/py", "/model", 8100, None, "0")
    assert argv[:3] == ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=0", "/py"]
    assert argv[3:5] == ["-m", "vllm.entrypoints.openai.api_server"] and "--kv-transfer-config" not in argv
    assert argv[argv.index("--model") + 1] == "/model" and argv[argv.index("--port") + 1] == "8100"
    assert argv[-2:] == ["--dtype", "float32"]
