"""Test support shipped with kvplane: emulated accelerator devices for CI (``kvplane.testing.emulated``).

Nothing here claims hardware support: an emulated device is always labelled "(emulated)".
"""
