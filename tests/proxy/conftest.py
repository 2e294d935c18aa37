"""Fixtures of the proxy tests: the misbehaving instances (``bad_server.py``), one process per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxyproc import BEHAVIOURS, Proc, spawn


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = spawn("bad_server.py", list(BEHAVIOURS), tmp_path_factory.mktemp("bad"), "bad")
    try:
        yield proc
    finally:
        proc.stop()
