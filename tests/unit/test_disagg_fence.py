"""The fence of a decode request (``phases.py``), driven by hypothesis: transfers into its blocks end at any time,
their completions arrive late, twice or never, verdicts (deadline, failure, abort) come at any point, and the
engine may be reset (the fence of last resort). The machine below applies each event exactly as ``DecodeSide``
does, through the same functions.

Invariants: the request is reported at most once, and its blocks released exactly once by the end; when it is
reported no transfer can still write its blocks; no transfer completion is applied after the request was
reported; a request with a verdict is draining, not reported, while a writer may still write.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplane.flows.disagg import phases
from kvplane.flows.disagg.phases import Phase

RANKS = st.integers(0, 3)


class DecodeRequest(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.phase = Phase.CONNECT
        self.pending: set[int] = set()  # prefill ranks whose transfer has not been seen to end
        self.live: set[int] = set()  # ranks whose transfer the engine still has: they can write the blocks
        self.inbox: list[int] = []  # completions sent and not yet delivered (any order, repeats)
        self.verdict = ""
        self.released = 0
        self.applied_after_report = 0

    def report(self) -> None:
        assert phases.may_report(self.phase, len(self.pending))
        assert not self.live, f"reported while ranks {self.live} can still write the blocks"
        self.phase = Phase.REPORTED
        self.released += 1

    @precondition(lambda self: self.phase is Phase.CONNECT and not self.verdict)
    @rule(writers=st.integers(1, 4))
    def start(self, writers: int) -> None:
        self.phase = phases.start(self.phase)
        self.pending = set(range(writers))
        self.live = set(self.pending)

    @rule(rank=RANKS)
    def transfer_ends_in_the_engine(self, rank: int) -> None:
        if rank in self.live:
            self.live.discard(rank)
            self.inbox.append(rank)

    @rule(data=st.data(), again=st.booleans())
    def a_completion_arrives(self, data: st.DataObject, again: bool) -> None:
        if not self.inbox:
            return
        rank = self.inbox[data.draw(st.integers(0, len(self.inbox) - 1))]
        if not again:
            self.inbox.remove(rank)
        reported = self.phase is Phase.REPORTED
        if phases.writer_ended(self.phase, self.pending, rank):
            self.applied_after_report += reported
            if not self.pending:
                self.report()

    @rule(state=st.sampled_from(["failed", "timed_out"]))
    def a_verdict(self, state: str) -> None:
        if self.phase is Phase.REPORTED:
            return
        self.verdict = self.verdict or state
        self.phase = phases.after_verdict(self.phase, len(self.pending))
        if self.phase is Phase.CONNECT or not self.pending:
            self.report()

    @precondition(lambda self: self.phase is Phase.DRAINING)
    @rule()
    def the_engine_is_reset(self) -> None:
        self.live.clear()  # the fence: the engine's transfers die with it
        self.pending.clear()
        self.report()

    @invariant()
    def reported_at_most_once_and_never_written_after(self) -> None:
        assert self.released <= 1
        assert self.applied_after_report == 0
        if self.phase is Phase.REPORTED:
            assert not self.live
        if self.verdict and self.phase is not Phase.REPORTED and self.live:
            assert self.phase is Phase.DRAINING

    def teardown(self) -> None:
        """Drive the request to its end: every block is released exactly once."""
        if self.phase is not Phase.REPORTED:
            self.a_verdict("timed_out")
        if self.phase is Phase.DRAINING:
            self.the_engine_is_reset()
        assert self.released == 1


DecodeRequest.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_a_decode_request_is_reported_once_and_never_written_after = DecodeRequest.TestCase
