"""``Pace``: how long a Mooncake waiter sleeps before the engine's spinning status call.

Sleeping too long delays a request; sleeping too little only spins. So: no sleep for a peer or size class not
seen yet, nor from batches too short to teach a rate; otherwise ``SHARE`` of the time the best recent rate
gives, which a batch that ended during the sleep raises.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvplane.transports.pacing import KEPT, MIN_LEARN_S, MIN_SLEEP_S, SHARE, Pace

MiB = 1 << 20


def test_a_peer_not_seen_yet_gets_no_sleep() -> None:
    assert Pace().head_start_s("a", 1 << 30, 625) == 0.0


def test_short_batches_teach_nothing() -> None:
    pace = Pace()
    pace.observe("a", 64 << 10, 1, MIN_LEARN_S / 2)  # mostly fixed costs: 64 KiB "at 26 MB/s"
    assert pace.head_start_s("a", 64 << 10, 1) == 0.0


def test_the_sleep_is_the_share_of_the_time_the_best_recent_rate_gives() -> None:
    pace = Pace()
    pace.observe("a", 1000 * MiB, 625, 1.0)
    pace.observe("a", 1000 * MiB, 625, 2.0)  # a slower batch does not lengthen the next sleep
    assert pace.head_start_s("a", 500 * MiB, 312) == pytest.approx(SHARE * 0.5)  # descriptors as large
    assert pace.head_start_s("b", 500 * MiB, 312) == 0.0  # another peer
    assert pace.head_start_s("a", 500 * MiB, 17_500) == 0.0  # another size class: many small descriptors


def test_a_batch_that_ended_during_the_sleep_raises_the_rate_and_old_batches_age_out() -> None:
    pace = Pace()
    pace.observe("a", 100 * MiB, 100, 1.0)
    first = pace.head_start_s("a", 100 * MiB, 100)
    pace.observe("a", 100 * MiB, 100, first)  # done before the waiter woke: it saw only its sleep
    assert pace.head_start_s("a", 100 * MiB, 100) == pytest.approx(SHARE * first)
    for _ in range(KEPT):
        pace.observe("a", 100 * MiB, 100, 4.0)  # the link got slower for good
    assert pace.head_start_s("a", 100 * MiB, 100) == pytest.approx(SHARE * 4.0)


def test_a_new_engine_starts_from_nothing() -> None:
    pace = Pace()
    pace.observe("a", 100 * MiB, 100, 1.0)
    pace.forget()
    assert pace.head_start_s("a", 100 * MiB, 100) == 0.0


@given(st.lists(st.tuples(st.integers(1, 1 << 32), st.integers(1, 1024), st.floats(0, 100)), max_size=20),
       st.integers(1, 1 << 32), st.integers(1, 1024))
def test_a_sleep_is_never_longer_than_the_share_of_the_fastest_time_seen(
    seen: list[tuple[int, int, float]], nbytes: int, descriptors: int
) -> None:
    pace = Pace()
    for b, d, s in seen:
        pace.observe("a", b, d, s)
    sleep = pace.head_start_s("a", nbytes, descriptors)
    assert sleep == 0.0 or sleep >= MIN_SLEEP_S
    learned = [b / s for b, d, s in seen if s >= MIN_LEARN_S
               and (b // d).bit_length() == (nbytes // descriptors).bit_length()]
    rates = learned[-KEPT:]
    if sleep:
        assert rates and sleep <= SHARE * nbytes / max(rates) * (1 + 1e-9)
