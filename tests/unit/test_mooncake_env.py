"""The variables kvplane sets around a Mooncake engine's start are seen by that start only.

Mooncake reads ``MC_FORCE_TCP`` and ``MC_TRANSFER_TIMEOUT`` from the process environment while it starts, so a
second engine starting on another thread in that window would pick up the first one's values (a TCP engine
forcing TCP on an RDMA one). kvplane's starts take turns: a start sees only its own values, or the user's.
"""

from __future__ import annotations

import os
import threading

import pytest

from kvplane.transports import mooncake

NAME = "MC_FORCE_TCP"


def test_a_start_on_another_thread_does_not_see_the_first_starts_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    inside, leave = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def tcp_start() -> None:
        with mooncake._env_default(NAME, "1"):
            inside.set()
            leave.wait(5)

    def other_start() -> None:
        with mooncake._env_default(NAME, None):
            seen.append(os.environ.get(NAME))

    first = threading.Thread(target=tcp_start)
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=other_start)
    second.start()
    second.join(0.2)  # it waits for the first start to end (or, unfixed, reads the first start's value now)
    leave.set()
    first.join(5)
    second.join(5)
    assert seen == [None]


def test_a_value_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "0")
    with mooncake._env_default(NAME, "1"):
        assert os.environ[NAME] == "0"
    assert os.environ[NAME] == "0"
