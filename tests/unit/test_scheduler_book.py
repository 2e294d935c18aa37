"""The scheduler half's per-request records (``scheduler_book.SchedulerBook``): the table names every phase, a
change of phase the table lacks raises, and the per-phase counts vLLM's per-step questions read always match
the records (hypothesis drives the book with every event in any order; the lifecycle under vLLM's own
Scheduler is tests/vllm/test_vllm_lifecycle_property.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.integrations.vllm.scheduler_book import TRANSITIONS, Phase, SchedulerBook

IDS = st.sampled_from(["a", "b", "c"])


def phase_of(book: SchedulerBook, rid: str) -> Phase | None:
    record = book.records.get(rid)
    return None if record is None else record.phase
EVENTS = st.lists(st.tuples(st.sampled_from(["to", "finish", "reported"]), IDS, st.sampled_from([*Phase, None])),
                  max_size=40)


def test_the_table_names_every_phase() -> None:
    named = {a for a, _, _ in TRANSITIONS} | {b for _, _, b in TRANSITIONS}
    assert named == {p.name for p in Phase} | {"-"}


def test_a_change_the_table_lacks_raises_naming_it() -> None:
    book = SchedulerBook()
    book.to("a", Phase.RECEIVING)
    with pytest.raises(RuntimeError, match="RECEIVING -> SENDING is not in TRANSITIONS"):
        book.to("a", Phase.SENDING)
    with pytest.raises(RuntimeError, match="RECEIVING -> - is not in TRANSITIONS"):
        book.finish("a", None)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_the_counts_match_the_records_whatever_comes(events: list[tuple[str, str, Phase | None]]) -> None:
    book = SchedulerBook()
    allowed = {(a, b) for a, _, b in TRANSITIONS}
    for kind, rid, phase in events:
        before = phase_of(book, rid)
        try:
            if kind == "to" and phase is not None:
                book.to(rid, phase)
            elif kind == "finish":
                book.finish(rid, phase if phase in (Phase.ABORTING, Phase.SENDING) else None)
            else:
                book.reported(rid, tuple(Phase))
        except RuntimeError:
            assert phase_of(book, rid) == (before or Phase.TRACKED)  # refused: nothing changed
        after = phase_of(book, rid)
        if before is not None and after is not None and before != after:
            assert (before.name, after.name) in allowed
        assert book.count == Counter(r.phase for r in book.records.values())  # zero counts compare as absent
        assert all(n >= 0 for n in book.count.values()), book.count
