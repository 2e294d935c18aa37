"""The disaggregation I/O loop's command queue (``flows/disagg/wire/loop.py``): the engine's work runs on the loop in
order, a command that raises is logged with its name instead of vanishing into a future nobody reads, and a
closed loop refuses work with a future that says so."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.loop import IOLoop


@pytest.fixture
def loop() -> Iterator[IOLoop]:
    io = IOLoop("kvplane-test-loop", tick=lambda: 0.05)
    io.start()
    yield io
    io.stop()


def test_commands_run_on_the_loop_thread_in_submission_order(loop: IOLoop) -> None:
    seen: list[tuple[int, bool]] = []
    futures = [loop.submit(lambda i=i: seen.append((i, loop.on_loop))) for i in range(100)]
    futures[-1].result(10)
    assert seen == [(i, True) for i in range(100)]


def test_a_command_that_raises_is_logged_with_its_name_even_when_nobody_reads_its_future(
    loop: IOLoop, caplog: pytest.LogCaptureFixture
) -> None:
    def on_handed() -> None:
        raise KeyError(1)

    with caplog.at_level(logging.ERROR):
        loop.submit(on_handed)  # the sides drop these futures: the error must still show
        loop.submit(lambda: None).result(10)  # the loop carries on with the next command
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "kvplane-test-loop" in errors[0].getMessage() and "on_handed" in errors[0].getMessage()
    assert "KeyError" in errors[0].getMessage()


def test_a_command_submitted_after_stop_gets_a_future_that_names_the_fix() -> None:
    io = IOLoop("kvplane-test-loop", tick=lambda: 0.05)
    io.start()
    io.stop()
    with pytest.raises(DisaggError, match="closed; create a new side"):
        io.submit(lambda: None).result(1)


def test_stop_runs_the_commands_queued_before_it_and_ends_the_thread() -> None:
    before = threading.active_count()
    io = IOLoop("kvplane-test-loop", tick=lambda: 0.05)
    io.start()
    ran: list[int] = []
    futures = [io.submit(lambda i=i: ran.append(i)) for i in range(20)]
    io.stop()
    assert ran == list(range(20)) and all(f.done() for f in futures)
    assert threading.active_count() == before
