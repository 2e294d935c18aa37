"""Test doubles shipped with kvplane, for CI and test suites; the product never imports this package.

- ``kvplane.testing.backends``: emulated accelerator backends (``npu-emulated``, ``mlu-emulated``), added to a
  registry by ``register_emulated`` or for a pytest session by ``-p kvplane.testing.pytest_plugin``;
- ``kvplane.testing.emulated`` and ``emulated_device``: the stand-in ``torch.<device>`` behind them.

Nothing here claims hardware support: an emulated backend's name, label and every report say "emulated".
"""
