"""The worker half's per-request records (``worker_book.WorkerBook``) driven by hypothesis the way
``WorkerSide`` drives them: receives and host-tier loads that start, end (ok or not) and are aborted at any
point, twice, or after they were reported; requests handed to the prefill side (a layer-wise one twice), refused
there, reported by it, and completions that are a peer's stray or repeat.

Invariants: each inbound request is reported exactly once, as a delayed free (sent) if vLLM aborted it first,
else received; the decode side is told of an abort once, and only for a receive it runs; each request handed
out is reported sent exactly once, a stray or repeated completion never; once all is reported the book is empty.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.integrations.vllm import scheduler_book, worker_book
from kvplane.integrations.vllm.worker_book import TRANSITIONS, Inbound, Outbound, WorkerBook
from kvplane.machines import transitions_table

IDS_ALL = [f"r{i}" for i in range(5)]
IDS = st.sampled_from(IDS_ALL)


class BookWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = WorkerBook()
        self.inbound: dict[str, bool] = {}  # running here: request id -> a host-tier load
        self.aborted: set[str] = set()
        self.decode_aborts: list[str] = []
        self.reported_in: list[tuple[str, str]] = []
        self.out: dict[str, str] = {}  # handed and not reported: transfer id -> request id
        self.reported_out: list[str] = []

    @rule(rid=IDS, host=st.booleans(), short=st.booleans())
    def start(self, rid: str, host: bool, short: bool) -> None:
        if rid in self.inbound:
            return  # one inbound transfer per request at a time (the scheduler's rule)
        self.book.loading(rid, short) if host else self.book.receiving(rid)
        self.inbound[rid] = host

    @rule(rid=IDS)
    def abort(self, rid: str) -> None:
        if self.book.abort(rid):
            assert rid in self.inbound and not self.inbound[rid] and rid not in self.aborted
            self.decode_aborts.append(rid)
        if rid in self.inbound:
            self.aborted.add(rid)

    @rule(rid=IDS)
    def end(self, rid: str) -> None:
        """The decode side's completion, or the host load's end, comes; the worker only asks for those it runs."""
        waited = {r for r in IDS_ALL if self.book.awaits_receive(r) or self.book.load_short(r) is not None}
        assert waited == set(self.inbound)
        assert all((self.book.load_short(r) is not None) == host for r, host in self.inbound.items())
        if rid not in waited:
            return
        how = self.book.ended(rid)
        assert how == ("sent" if rid in self.aborted else "received"), (rid, how)
        self.reported_in.append((rid, how))
        del self.inbound[rid]
        self.aborted.discard(rid)
        if rid in self.decode_aborts:  # that abort was this receive's; a later one of the same id may abort again
            self.decode_aborts.remove(rid)

    @rule(rid=IDS)
    def failed_to_start(self, rid: str) -> None:
        if rid not in self.inbound:
            assert self.book.ended(rid) == "received"

    @rule(rid=IDS, layerwise=st.booleans())
    def hand(self, rid: str, layerwise: bool) -> None:
        tid = f"t-{rid}"
        if tid in self.out or rid in self.out.values():
            return
        self.book.handed(tid, rid)
        if layerwise:
            self.book.handed(tid, rid)  # its start, then its end
        self.out[tid] = rid

    @rule(rid=IDS)
    def refuse(self, rid: str) -> None:
        tid = f"t-{rid}"
        if tid in self.out:
            self.book.refused(tid)
            assert self.book.outbound[tid].phase is Outbound.REFUSED

    @rule(rid=IDS)
    def prefill_reports(self, rid: str) -> None:
        tid = f"t-{rid}"
        got = self.book.sent(tid)
        handed = tid in self.out and self.book.outbound.get(tid) is None
        if got is not None:
            assert handed and got == self.out.pop(tid)
            self.reported_out.append(got)
        else:
            assert tid not in self.out or self.book.outbound[tid].phase is Outbound.REFUSED

    @rule()
    def report_refused(self) -> None:
        for rid in self.book.take_refused():
            assert self.out.pop(f"t-{rid}") == rid
            self.reported_out.append(rid)

    @invariant()
    def tables_match(self) -> None:
        assert {rid for rid, r in self.book.inbound.items() if r.phase is Inbound.ABORTED} == self.aborted
        assert {t: r.request_id for t, r in self.book.outbound.items()} == self.out
        assert len(self.decode_aborts) == len(set(self.decode_aborts))

    def teardown(self) -> None:
        for rid in list(self.inbound):
            self.end(rid)
        self.report_refused()
        for tid in list(self.out):
            self.prefill_reports(tid.removeprefix("t-"))
        assert not any(self.book.held().values()), self.book.held()


TestBook = BookWorld.TestCase
TestBook.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_table_names_every_phase() -> None:
    named = {a for a, _, _ in TRANSITIONS} | {b for _, _, b in TRANSITIONS}
    assert named == {p.name for p in (*Inbound, *Outbound)} | {"-"}


def test_docs_carry_both_books_tables() -> None:
    text = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    for name, module in (("scheduler-book", scheduler_book), ("worker-book", worker_book)):
        block = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
        assert block is not None, f"docs/vllm.md lost its {name} block"
        assert block.group(1) == transitions_table(module.TRANSITIONS), f"docs/vllm.md: paste the {name} table in"
