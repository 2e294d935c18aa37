"""The decode's connection to a prefill rank (``decode_link.Link``) driven by hypothesis: requests and declines
naming the rank (now and then another lifetime of it), its answers (handshakes and rejects, good and bad) lost,
repeated, late or under an old number, transport probes that end well or badly, resets of this rank's engine
(and its coming back), READs that fail, and a fake clock. The test carries the actions out as
``decode_conns.DecodeConnections`` does and checks what the prefill would see.

Invariants: handshake numbers only grow, and none is sent while this rank's engine is down; only the answer to
the latest number is checked, and only once; a link is ready only through a probe of such an answer; an answer
to a handshake sent before a reset of this rank's engine is never checked while the link handshakes; every
failure sets a backoff; and no link waits forever: once the engine runs, two handshake timeouts end any wait.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.flows.disagg.decode.decode_link import (
    RETRY_MAX_S,
    TRANSITIONS,
    Check,
    EngineView,
    Failed,
    Link,
    LinkAction,
    LinkPhase,
    Note,
    Probe,
    Ready,
    SendHello,
    transitions_table,
)

TIMEOUT_S = 5.0


class LinkWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.link = Link(TIMEOUT_S)
        self.now = 100.0
        self.generation, self.runs = 0, True  # this rank's engine
        self.sent: dict[int, int] = {}  # handshake number -> the engine generation it named
        self.checked: set[int] = set()  # numbers whose answer was checked
        self.probing: int | None = None  # the number whose answer is being probed
        self.ready_from: int | None = None  # the number whose answer made the link ready

    @property
    def engine(self) -> EngineView:
        return EngineView(self.generation, self.runs)

    def run(self, actions: list[LinkAction], answer: int | None = None, good: bool = True) -> None:
        for action in actions:
            if isinstance(action, SendHello):
                assert self.runs, "a handshake was sent while this rank's engine is down"
                assert action.attempt == max(self.sent, default=0) + 1, (action, self.sent)
                self.sent[action.attempt] = self.generation
                self.probing = None
            elif isinstance(action, Check):
                assert answer == self.link.attempt and answer not in self.checked, (answer, self.link.attempt)
                self.checked.add(answer)
                self.run(self.link.checked(self.now, "" if good else "the answer does not check out"), answer)
            elif isinstance(action, Probe):
                assert self.link.phase is LinkPhase.PROBING
                self.probing = answer
            elif isinstance(action, Ready):
                assert self.link.phase is LinkPhase.READY and self.probing == self.link.attempt
                self.ready_from, self.probing = self.probing, None
            elif isinstance(action, Failed):
                assert self.link.phase is LinkPhase.FAILED and action.reason == self.link.error
                assert self.now < self.link.retry_at <= self.now + RETRY_MAX_S
                self.probing = None
            else:
                assert isinstance(action, Note), action

    # -- the rank's requests and declines ---------------------------------------------------------------
    @rule(other_lifetime=st.booleans())
    def need(self, other_lifetime: bool) -> None:
        self.run(self.link.need(self.now, self.engine, "boot-2" if other_lifetime else ""))

    @rule()
    def decline_waits(self) -> None:
        self.run(self.link.retry(self.now, self.engine))

    @rule()
    def read_failed(self) -> None:
        self.run(self.link.stale())

    # -- the prefill's answers ---------------------------------------------------------------------------
    @rule(back=st.integers(0, 3), reject=st.booleans(), good=st.booleans())
    def answer(self, back: int, reject: bool, good: bool) -> None:
        """An answer to the latest handshake, or to one ``back`` numbers before it (late, or sent twice)."""
        if not self.sent:
            return
        attempt = max(1, max(self.sent) - back)
        before = (self.link.phase, self.generation != self.sent[attempt])
        actions = self.link.answer(self.now, attempt, "not now" if reject else None, self.engine)
        if before == (LinkPhase.HANDSHAKING, True):  # it named an engine of this rank that is gone
            assert not any(isinstance(a, Check) for a in actions), actions
        self.run(actions, attempt, good)

    @rule(ok=st.booleans())
    def probe_ends(self, ok: bool) -> None:
        if self.probing is not None:
            self.run(self.link.probed(self.now, "" if ok else "its transport does not answer", "boot-1"))

    # -- this rank's engine, and the clock ---------------------------------------------------------------
    @rule()
    def reset(self) -> None:
        self.generation, self.runs = self.generation + 1, False
        self.run(self.link.stale())

    @rule()
    def engine_back(self) -> None:
        self.runs = True

    @rule(dt=st.sampled_from([0.01, 1.0, TIMEOUT_S + 0.1, 40.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.run(self.link.tick(self.now, self.engine))

    # -- what must hold ----------------------------------------------------------------------------------
    @invariant()
    def numbers_match(self) -> None:
        assert self.link.attempt == max(self.sent, default=0)
        if self.link.phase is LinkPhase.HANDSHAKING:
            assert self.sent[self.link.attempt] == self.link.generation

    @invariant()
    def ready_only_through_a_probe_of_the_latest_answer(self) -> None:
        if self.link.usable:
            assert self.ready_from == self.link.attempt and self.ready_from in self.checked
        if self.link.phase is LinkPhase.FAILED:
            assert self.link.error and self.link.failures >= 1

    def teardown(self) -> None:
        """No link waits forever: once this rank's engine runs, two handshake timeouts end any wait."""
        self.runs = True
        for _ in range(2):
            self.now += TIMEOUT_S + 0.1
            self.run(self.link.tick(self.now, self.engine))
        assert self.link.phase not in (LinkPhase.DEFERRED, LinkPhase.HANDSHAKING, LinkPhase.PROBING), self.link.phase


TestLink = LinkWorld.TestCase
TestLink.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_late_answer_to_a_timed_out_handshake_still_makes_the_link_ready() -> None:
    """The prefill stalled past handshake_timeout_s and then answered: it took the handshake, and declines may
    wait for the rank, so the answer counts."""
    link, engine = Link(TIMEOUT_S), EngineView(0, True)
    assert link.need(0.0, engine) == [SendHello(1)]
    assert link.tick(TIMEOUT_S + 1, engine) == [Failed(link.error)] and "no answer" in link.error
    assert link.answer(TIMEOUT_S + 2, 1, None, engine) == [Check()]
    assert link.checked(TIMEOUT_S + 2) == [Probe()]
    assert link.probed(TIMEOUT_S + 2, boot_id="b") == [Ready()] and link.failures == 0


def test_a_handshake_owed_while_the_engine_is_down_goes_out_once_it_runs() -> None:
    link = Link(TIMEOUT_S)
    assert link.need(0.0, EngineView(1, False)) == [] and link.phase is LinkPhase.DEFERRED
    assert link.tick(1.0, EngineView(1, False)) == []
    assert link.tick(2.0, EngineView(1, True)) == [SendHello(1)] and link.generation == 1


def test_the_backoff_doubles_and_stops_at_its_cap() -> None:
    link, engine, now, waits = Link(TIMEOUT_S), EngineView(0, True), 0.0, []
    for _ in range(10):
        link.need(now, engine)
        now += TIMEOUT_S + 1
        link.tick(now, engine)
        waits.append(link.retry_at - now)
    assert waits[:3] == [0.5, 1.0, 2.0] and waits[-1] == RETRY_MAX_S


def test_docs_carry_the_link_machines_table() -> None:
    text = (Path(__file__).parents[2] / "docs" / "disagg.md").read_text()
    block = re.search(r"<!-- link-transitions:begin -->\n(.*?)\n<!-- link-transitions:end -->", text, re.S)
    assert block is not None, "docs/disagg.md: the link machine's table is missing"
    assert block.group(1) == transitions_table(), "docs/disagg.md: paste decode_link.transitions_table() in"
    assert len({(a, b) for a, _, b in TRANSITIONS}) == len(TRANSITIONS)


def test_a_timeout_says_whether_the_answer_or_the_transport_never_came() -> None:
    """Both ran out handshake_timeout_s under one message, "no answer to the handshake": a live 2P2D failure
    could not tell a prefill that never answered from a transport connect that never ended."""
    silent, engine = Link(TIMEOUT_S), EngineView(0, True)
    silent.need(0.0, engine)
    silent.tick(TIMEOUT_S + 1, engine)
    assert f"no answer to handshake 1 within handshake_timeout_s={TIMEOUT_S}" in silent.error
    stuck = Link(TIMEOUT_S)
    stuck.need(0.0, engine)
    stuck.answer(1.0, 1, None, engine)
    assert stuck.checked(1.0) == [Probe()]
    stuck.tick(TIMEOUT_S + 2, engine)
    assert "answered, but connecting its transport did not end" in stuck.error and "no answer" not in stuck.error
