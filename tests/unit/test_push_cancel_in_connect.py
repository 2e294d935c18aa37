"""A push-mode decode request that gives up while still in ``CONNECT`` (a handshake with another prefill rank
failed, the client aborted, its deadline passed) sends ``Cancel`` to every prefill rank: at once to those it
handshook with, and to one still handshaking (or whose handshake failed) once a handshake with it succeeds, as
``DecodeSide`` keeps declines. So every rank it reaches frees the request's blocks at once instead of at its lease's
or push timeout's end.

The real decode machine (``DecodeRequest``) against the real prefill machines (``HeldRequest``, one per prefill
rank, carried out as ``PrefillSide`` does: ``test_pd_machines_joint.RealPrefill``), over a channel that reorders
but never loses (a lost message is what the lease is for). Hypothesis interleaves the handshakes, a failing one,
the prefill engine's hand-over on each rank (before or after the Cancel), heartbeats, the decode waiting for
staging room (``Start`` answered ``no_room``: it stays in ``CONNECT`` with every rank ready), its give-up, the
delivery order and a clock that stays far below the lease; a handshake may also succeed after the request gave
up (the connection outlives it). Once the prefill engine handed the request over everywhere and every message was
delivered, each rank the decode got a handshake through to has released the request ``failed``, without the lease
or push timeout passing (a rank never reached frees at its push timeout: nothing can be sent to it).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from test_pd_machines_joint import RealPrefill

from kvplane.flows.disagg.decode.decode_actions import Action, GiveStaging, Note, Report, Send, Start
from kvplane.flows.disagg.decode.decode_request import DecodeRequest, Ident, Phase, RankView
from kvplane.flows.disagg.prefill.held_request import HeldRequest, Terms
from kvplane.flows.disagg.wire.messages import Heartbeat, Problem, PushResult

HOLD_S = 1000.0  # the prefill's lease and push timeout: the clock never gets near it
DEADLINE_S = 2.0  # the decode request's: passing it is one way to give up
PREFILL_ENGINE, BOOT = "prefill", "boot-0"


class LongHold(RealPrefill):
    def machine(self, rid: str, r: int) -> HeldRequest:
        rank = self.rank(r)
        if rid not in rank.machines:
            rank.machines[rid] = HeldRequest(rid, Terms(r, HOLD_S, HOLD_S), deadline=self.clock() + HOLD_S)
        return rank.machines[rid]


class CancelInConnect(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.tp = 2
        self.prefill = LongHold(lambda: self.now)
        ident = Ident("d", "push", "p", PREFILL_ENGINE, "", "tok", self.tp, "decode", 0, 1, 1.0)
        self.machine = DecodeRequest(ident, deadline=DEADLINE_S)
        self.views = {r: RankView("waiting", f"127.0.0.1:{5600 + r}") for r in range(self.tp)}
        self.wire: list[tuple[int, object]] = []
        self.handed: set[int] = set()
        self.queued: dict[int, list[object]] = {r: [] for r in range(self.tp)}  # DecodeSide's kept declines
        self.reached: set[int] = set()  # ranks a handshake got through to, before or after the give-up
        self.reports: list[Report] = []

    # -- the decode shell, as DecodeSide._run does it --------------------------------------------------------
    def run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                if not a.ready_only or self.views[a.rank].state == "ready":
                    self.wire.append((a.rank, a.message))
                elif a.later:
                    self.queued[a.rank].append(a.message)
            elif isinstance(a, Start):  # every rank is ready: the staging arena is full for now
                self.run(self.machine.no_room())
            elif isinstance(a, Report):
                self.reports.append(a)
            else:
                assert isinstance(a, GiveStaging | Note), f"{a} in CONNECT"
        if self.machine.verdict is not None:
            assert self.machine.phase is Phase.REPORTED  # nothing was registered: reported at once

    def connecting(self) -> bool:
        return self.machine.phase is Phase.CONNECT and self.machine.verdict is None

    # -- rules -----------------------------------------------------------------------------------------------
    @rule(rank=st.integers(0, 1))
    def a_rank_handshakes(self, rank: int) -> None:
        """The first handshake, or (after the give-up) a later request's with a rank whose handshake failed."""
        if self.views[rank].state != "ready":
            self.views[rank] = RankView("ready", self.views[rank].where, "", PREFILL_ENGINE, BOOT)
            self.reached.add(rank)
            self.wire += [(rank, m) for m in self.queued[rank]]  # DecodeSide._conn_ready
            self.queued[rank].clear()
            if self.connecting():
                self.run(self.machine.connections(dict(self.views)))

    @precondition(lambda self: self.connecting())
    @rule(rank=st.integers(0, 1))
    def a_handshake_fails(self, rank: int) -> None:
        if self.views[rank].state == "waiting":
            self.views[rank] = RankView("failed", self.views[rank].where, "no answer to the handshake")
            self.run(self.machine.connections(dict(self.views)))

    @precondition(lambda self: self.connecting())
    @rule()
    def the_client_aborts(self) -> None:
        self.run(self.machine.abort())

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        assert self.now < HOLD_S / 10
        self.run(self.machine.tick(self.now))  # past DEADLINE_S: the decode gives up
        self.replies(self.prefill.tick())

    @rule()
    def the_decode_heartbeats(self) -> None:
        for send in self.machine.heartbeat():
            if self.views[send.rank].state == "ready":
                self.wire.append((send.rank, send.message))

    @rule(rank=st.integers(0, 1))
    def the_prefill_engine_hands_over(self, rank: int) -> None:
        if rank not in self.handed:
            self.handed.add(rank)
            self.replies(self.prefill.hand_over("p", rank))

    @precondition(lambda self: bool(self.wire))
    @rule(data=st.data())
    def a_message_arrives(self, data: st.DataObject) -> None:
        rank, message = self.wire.pop(data.draw(st.integers(0, len(self.wire) - 1)))
        self.replies(self.prefill.receive(rank, message), rank)  # type: ignore[arg-type]

    def replies(self, messages: list[PushResult | Problem], rank: int = 0) -> None:
        for m in messages:
            if isinstance(m, Problem) and m.request_id:
                self.run(self.machine.problem(m.rank, m.reason))
            elif isinstance(m, PushResult):
                self.run(self.machine.push_result(m.rank, m.ok, m.reason))

    # -- the end ---------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        if self.connecting():
            self.run(self.machine.abort())  # every run ends with a give-up in CONNECT
        for rank in range(self.tp):
            self.the_prefill_engine_hands_over(rank)
        while self.wire:
            rank, message = self.wire.pop(0)
            if not isinstance(message, Heartbeat):
                self.replies(self.prefill.receive(rank, message), rank)  # type: ignore[arg-type]
        assert len(self.reports) == 1 and self.reports[0].state != "done", self.reports
        assert self.now < HOLD_S
        for rank in sorted(self.reached):
            released = self.prefill.rank(rank).released.get("p", [])
            assert [c.state for c in released] == ["failed"], \
                f"prefill rank {rank}, which a handshake got through to, released {released} (it holds the " \
                f"blocks until its push timeout)"
            assert "p" not in self.prefill.rank(rank).machines


CancelInConnect.TestCase.settings = settings(max_examples=300, stateful_step_count=25, deadline=None)
test_a_push_given_up_in_connect_frees_the_prefills_blocks_without_the_lease = CancelInConnect.TestCase
