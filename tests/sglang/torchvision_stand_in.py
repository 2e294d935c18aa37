"""A stand-in for ``torchvision`` where it is not installed, so SGLang's ``mem_cache`` imports on CPU.

SGLang imports torchvision at module level only for vision models' image preprocessing
(``sglang/srt/multimodal/internvl_utils.py:5``, ``sglang/srt/configs/deepseek_ocr.py:7``), reached from
``sglang/srt/configs/__init__.py``, which ``mem_cache/memory_pool.py:58`` imports. torchvision is built for one
exact torch release and pulls its own torch, so the SGLang venv does not install it. The stand-in answers
every ``import torchvision...`` and every name in it; calling any of them raises ``ModuleNotFoundError``. It
is put in place only after ``transformers`` has answered, from the real environment, that torchvision is
absent (``is_torchvision_available`` is cached), so transformers does not take the stand-in for the package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

NAME = "torchvision"


class Absent:
    """A torchvision name: attributes give more of them, calling one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(f"{self._name} was called, but torchvision is not installed in the SGLang test "
                                  f"venv (tests/sglang/torchvision_stand_in.py)")


class StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self.__name__}.{attr}")


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == NAME or fullname.startswith(NAME + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def install_if_missing() -> None:
    """Put the stand-in in place when torchvision is not installed; leave a real one alone."""
    if importlib.util.find_spec(NAME) is not None or any(isinstance(f, Finder) for f in sys.meta_path):
        return
    try:
        from transformers.utils import import_utils
    except ImportError:
        pass
    else:
        assert not import_utils.is_torchvision_available()  # cached now, from the real environment
    sys.meta_path.append(Finder())
