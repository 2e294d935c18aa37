"""Fixtures of the P/D tests: the pool of rank worker processes (``rank_pool.py``), one per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rank_pool import Pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = Pool(tmp_path_factory.mktemp("ranks"))
    try:
        yield p
    finally:
        p.close()
