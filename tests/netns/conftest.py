"""Fixtures of the namespace tests: a fresh ``Link`` per test, deleted even when the test fails; skipped, with
the reason, where namespaces cannot be made (not root, a kernel that refuses them, ``ip``/``tc``/``iptables``
missing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nslink import Link, unavailable


@pytest.fixture
def link() -> Iterator[Link]:
    why = unavailable(need_iptables=True)
    if why:
        pytest.skip(why)
    made = Link()
    try:
        yield made
    finally:
        made.close()
