"""The SGLang HiCache backend's tests run against SGLang itself, in its own venv (``.venv-sglang``).

Where SGLang is not installed (``.venv``, the main suite) the whole folder is skipped, saying so; where it is
installed and does not import, the tests fail loudly. SGLang's ``mem_cache`` imports ``torchvision`` on the way
(``sglang/srt/configs/__init__.py`` -> ``configs/nano_nemotron_vl.py:22`` and ``configs/deepseek_ocr.py:7`` ->
``sglang/srt/multimodal/internvl_utils.py:5``: image preprocessing of vision models), and torchvision is a
compiled companion of one exact torch build, not installed here: a stand-in whose every name raises when used
takes its place (``torchvision_stand_in.py``). No pool or storage code of SGLang touches it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

NO_SGLANG = ("SGLang is not installed in this environment; tests/sglang runs in .venv-sglang "
             "(.venv-sglang/bin/python -m pytest tests/sglang)")

if importlib.util.find_spec("sglang") is None:

    class SkippedModule(pytest.Module):
        """A test module of this folder, skipped with the reason instead of imported."""

        def _getobj(self) -> Any:
            pytest.skip(NO_SGLANG, allow_module_level=True)

    def pytest_pycollect_makemodule(module_path: Any, parent: Any) -> Any:
        return SkippedModule.from_parent(parent, path=module_path)

else:
    from torchvision_stand_in import install_if_missing

    install_if_missing()

if TYPE_CHECKING:
    from kvplane.flows.offload import MooncakeMaster
    from kvplane.integrations.sglang.backend import KvplaneHiCacheStorage


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    from kvplane.flows.offload import start_master

    m = start_master()
    yield m
    m.stop()


@pytest.fixture
def backends() -> Iterator[Callable[..., KvplaneHiCacheStorage]]:
    """Makes backends as SGLang's factory does (``backend_class(storage_config, kwargs)``), closes them after."""
    from kvplane.integrations.sglang.backend import KvplaneHiCacheStorage

    made: list[KvplaneHiCacheStorage] = []

    def make(storage_config: Any, pool: Any = None) -> KvplaneHiCacheStorage:
        backend = KvplaneHiCacheStorage(storage_config, {})
        made.append(backend)
        if pool is not None:
            backend.register_mem_pool_host(pool)
        return backend

    yield make
    for backend in made:
        backend.close()
