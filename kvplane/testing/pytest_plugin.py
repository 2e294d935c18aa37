"""A pytest plugin that adds the emulated backends to the session's registry: ``-p kvplane.testing.pytest_plugin``.

``kvplane conformance --emulate`` passes it to the suite's pytest process, which then certifies
``--kvplane-device=<name>-emulated``. It runs before the conformance plugin selects its device.
"""

from __future__ import annotations

import pytest

from kvplane.backend.registry import default_registry
from kvplane.testing.backends import register_emulated


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    register_emulated(default_registry())
