"""A backend plugin whose module cannot be imported (its device package is missing), for test_registry."""

import kvplane_fake_device_runtime_not_installed  # noqa: F401
