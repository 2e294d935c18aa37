"""kvplane's C extensions, built by ``pip install`` from the sources beside this file.

``optional(name)`` imports one: the module and "", or None and the import error where the package was installed
without building its C files; each caller falls back, or says how to build them.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"kvplane._native.{name}"), ""
    except ImportError as e:
        return None, str(e)
