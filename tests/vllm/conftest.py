"""Fixtures the tests that drive vLLM's real Scheduler share: one tiny model directory per module, the
engines a test made, shut down after it whatever happened, and a real ``mooncake_master`` per module for the
store-tier tests. ``realsched`` (which imports vLLM) is imported only when a test asks for them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from realsched import RealEngine

    from kvplane.flows.offload import MooncakeMaster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from realsched import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def engines() -> Iterator[list[RealEngine]]:
    made: list[RealEngine] = []
    yield made
    for e in made:
        e.shutdown()


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    """An ``ipc://`` endpoint for vLLM's KV-event publisher (it binds ipc endpoints)."""
    return f"ipc://{tmp_path / 'kv-events.sock'}"


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    from kvplane.flows.offload import start_master

    m = start_master()
    yield m
    m.stop()
