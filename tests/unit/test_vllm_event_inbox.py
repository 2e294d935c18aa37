"""The scheduler half's event inbox: an event is ready once every worker reported it, in the step it completes,
counted across steps (a store-tier put may complete a step later on one rank); a lone worker's events are
ready at once; both tables stay bounded, the oldest dropped and counted, one warning."""

from __future__ import annotations

import logging

import pytest

from kvplane.integrations.vllm.event_inbox import EventInbox


def test_a_single_worker_s_events_are_ready_at_once_in_order() -> None:
    inbox = EventInbox()
    inbox.add(["a", "b"], workers=0)  # vLLM says 0 where one worker reports alone
    assert inbox.take() == ["a", "b"] and inbox.take() == [] and inbox.pending() == 0


def test_an_event_waits_for_every_worker_even_across_steps() -> None:
    inbox = EventInbox()
    inbox.add(["a", "b", "a"], workers=2)  # both ranks reported a, one reported b
    assert inbox.take() == ["a"] and inbox.pending() == 1
    inbox.add(["b"], workers=2)  # the other rank's b, a step later
    assert inbox.take() == ["b"] and inbox.pending() == 0


def test_the_inbox_stays_bounded_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    inbox = EventInbox(limit=3)
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        inbox.add(["a", "b", "c", "d", "e"], workers=2)  # never seen from the other rank
        inbox.add(["f"], workers=2)
    assert inbox.pending() == 3 and inbox.dropped == 3
    assert caplog.text.count("dropping the oldest") == 1
    inbox.add(["f", "e"], workers=2)  # the newest partial counts survived
    assert inbox.take() == ["f", "e"]
