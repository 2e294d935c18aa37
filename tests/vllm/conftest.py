"""Fixtures the tests that drive vLLM's real Scheduler share: one tiny model directory per module, and the
engines a test made, shut down after it whatever happened. ``realsched`` (which imports vLLM) is imported only
when a test asks for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from realsched import RealEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from realsched import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def engines() -> Iterator[list[RealEngine]]:
    made: list[RealEngine] = []
    yield made
    # side by side: shutting down a connector with a Mooncake side idles about 1 s (Mooncake's handshake
    # listener waits out its accept timeout); every engine is shut down, then the first error is raised
    errors: list[BaseException] = []

    def shut(engine: RealEngine) -> None:
        try:
            engine.shutdown()
        except BaseException as e:
            errors.append(e)

    others = [threading.Thread(target=shut, args=(e,)) for e in made[1:]]
    for t in others:
        t.start()
    if made:
        shut(made[0])
    for t in others:
        t.join()
    if errors:
        raise errors[0]
