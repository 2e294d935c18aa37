"""Fixtures the integration tests share: one real ``mooncake_master`` per module that asks for ``master``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.flows.offload import MooncakeMaster, start_master


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    m = start_master()
    yield m
    m.stop()
