"""Decode request machines (``decode_request.DecodeRequest``) driven by hypothesis against honest prefill ranks
(``decode_world.HonestPrefill``) through a channel that loses, repeats and reorders messages both ways, with
handshakes that fail, staging that runs out, plans that fail, READs and WRITEs that end well or badly, aborts,
prefill restarts, deadlines (a fake clock) and engine resets (the fence) at any point. The test carries the
machines' actions out as ``DecodeSide`` does.

Invariants: each request gets exactly one Completion; none is reported while a READ or a WRITE may still land
in its blocks; its staging is given back exactly once, and only once nothing writes it; a request is ``done``
only if every prefill rank's transfer ended with its bytes landed; after the last request nothing is left.

To run the real prefill machine instead of the model: subclass ``World`` with ``make_prefill`` returning an object
with the methods of ``decode_world.PrefillRanks`` (see that module), and run that subclass's ``TestCase``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_world import HonestPrefill, PrefillRanks, Reply
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvplane.flows.disagg.decode.decode_actions import (
    Action,
    Fence,
    GiveStaging,
    MarkStale,
    Note,
    Relayout,
    Report,
    Send,
    Start,
    ToPrefill,
)
from kvplane.flows.disagg.decode.decode_request import DecodeRequest, Ident, Phase, RankView
from kvplane.flows.disagg.wire.messages import Problem, PushRegister, PushResult

DEADLINE_S, DRAIN_S = 5.0, 2.0
MAX_REQUESTS = 3
MODES = st.sampled_from(["pull", "push"])
MOSTLY = st.sampled_from([True, True, True, False])
SELDOM = st.sampled_from([False, False, False, True])


@dataclass
class Req:
    machine: DecodeRequest
    tp: int
    plannable: bool
    conns: dict[int, RankView]
    reads: set[int] = field(default_factory=set)  # pull: READs this rank's engine still runs
    landed: set[int] = field(default_factory=set)  # ranks whose bytes all landed
    broken: set[int] = field(default_factory=set)  # ranks whose transfer ended without its bytes
    gives: int = 0
    reports: list[Report] = field(default_factory=list)


class World(RuleBasedStateMachine):
    @staticmethod
    def make_prefill() -> PrefillRanks:
        return HonestPrefill()

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.prefill = self.make_prefill()
        self.reqs: dict[str, Req] = {}
        self.wire: list[tuple[str, int, ToPrefill | Reply]] = []  # ("to_prefill" | "to_decode", rank, message)
        self.fences: list[str] = []
        self.room = True
        self.count = 0

    # -- the shell --------------------------------------------------------------------------------------
    def run(self, rid: str, actions: list[Action]) -> None:
        req = self.reqs[rid]
        for a in actions:
            if isinstance(a, Send):
                if not a.ready_only or req.conns[a.rank].state == "ready":
                    self.wire.append(("to_prefill", a.rank, a.message))
            elif isinstance(a, Start):
                self.start(rid)
            elif isinstance(a, Relayout):
                self.run(rid, req.machine.relaid_out())
            elif isinstance(a, Fence):
                self.fences.append(rid)
            elif isinstance(a, GiveStaging):
                assert not self.writers(rid), f"{rid}: staging given back while {self.writers(rid)} may write it"
                req.gives += 1
            elif isinstance(a, Report):
                self.report(rid, a)
            else:
                assert isinstance(a, MarkStale | Note)

    def start(self, rid: str) -> None:
        req = self.reqs[rid]
        if not req.plannable:
            self.run(rid, req.machine.cannot_plan("the model cannot plan it"))
        elif not self.room:
            self.run(rid, req.machine.no_room())
        else:
            ranks = range(req.tp)
            if req.machine.ident.mode == "pull":
                req.reads = set(ranks)
            else:
                self.wire += [("to_prefill", r, _register(req.machine, r)) for r in ranks]
            self.run(rid, req.machine.started(ranks))

    def writers(self, rid: str) -> set[int]:
        req = self.reqs[rid]
        return req.reads | self.prefill.writing(req.machine.ident.remote_request_id)

    def report(self, rid: str, report: Report) -> None:
        req = self.reqs[rid]
        assert not req.reports, f"{rid} reported twice: {req.reports} then {report}"
        assert not self.writers(rid), f"{rid} reported {report.state} while ranks {self.writers(rid)} may write"
        assert req.gives == 1, f"{rid}: staging given back {req.gives} times by its report"
        if report.state == "done":
            assert req.landed == set(range(req.tp)) and not req.broken, \
                f"{rid} done with landed={req.landed} broken={req.broken}"
        req.reports.append(report)
        event(f"{req.machine.ident.mode} tp={req.tp} {report.state}")

    def replies(self, replies: list[Reply]) -> None:
        self.wire += [("to_decode", r.rank, r) for r in replies]

    def active(self) -> list[str]:
        return sorted(rid for rid, r in self.reqs.items() if not r.reports)

    # -- events -----------------------------------------------------------------------------------------
    @initialize(mode=MODES, tp=st.integers(1, 3), plannable=MOSTLY)
    def the_first_request_arrives(self, mode: str, tp: int, plannable: bool) -> None:
        self.a_request_arrives(mode, tp, plannable)

    @rule(mode=MODES, tp=st.integers(1, 3), plannable=MOSTLY)
    def a_request_arrives(self, mode: str, tp: int, plannable: bool) -> None:
        if self.count >= MAX_REQUESTS:
            return
        rid = f"r{self.count}"
        self.count += 1
        ident = Ident(rid, "pull" if mode == "pull" else "push", f"p-{rid}", "prefill", "boot-0", "tok", tp,
                      "decode", 0, 1, DRAIN_S)
        conns = {r: RankView("waiting", f"h:{r}") for r in range(tp)}
        self.reqs[rid] = Req(DecodeRequest(ident, self.now + DEADLINE_S), tp, plannable, conns)
        self.run(rid, self.reqs[rid].machine.connections(conns))

    @rule(data=st.data())
    def handshakes_end(self, data: st.DataObject) -> None:
        """The handshakes a request waits on end, each ready, failed or with a prefill that restarted."""
        if self.waiting():
            rid = data.draw(st.sampled_from(sorted({rid for rid, _ in self.waiting()})))
            for r in [r for q, r in self.waiting() if q == rid]:
                self.handshake_ends(rid, r, data.draw(st.sampled_from(["ready"] * 6 + ["failed", "wrong boot"])))

    def waiting(self) -> list[tuple[str, int]]:
        return [(rid, r) for rid in self.active() for r, v in self.reqs[rid].conns.items() if v.state == "waiting"]

    def handshake_ends(self, rid: str, rank: int, outcome: str) -> None:
        req = self.reqs[rid]
        req.conns[rank] = RankView("failed", f"h:{rank}", "refused") if outcome == "failed" else \
            RankView("ready", f"h:{rank}", "", "prefill", "boot-1" if outcome == "wrong boot" else "boot-0")
        self.run(rid, req.machine.connections(dict(req.conns)))

    @rule(full=st.booleans())
    def staging_room_changes(self, full: bool) -> None:
        self.room = not full

    @rule(data=st.data(), ok=st.booleans(), timed_out=st.booleans())
    def a_read_ends(self, data: st.DataObject, ok: bool, timed_out: bool) -> None:
        reads = [(rid, r) for rid, req in self.reqs.items() for r in req.reads]
        if not reads:
            return
        rid, rank = data.draw(st.sampled_from(sorted(reads)))
        req = self.reqs[rid]
        req.reads.discard(rank)
        (req.landed if ok else req.broken).add(rank)
        self.run(rid, req.machine.transfer_ended(rank, "" if ok else "link down", timed_out))

    @rule(data=st.data(), ok=st.booleans())
    def a_write_ends_on_the_prefill(self, data: st.DataObject, ok: bool) -> None:
        writes = sorted(self.prefill.in_flight())
        if not writes:
            return
        self.a_write_ends_on_the_prefill_now(*data.draw(st.sampled_from(writes)), ok)

    def a_write_ends_on_the_prefill_now(self, remote: str, rank: int, ok: bool) -> None:
        replies = self.prefill.write_ends(remote, rank, ok)
        req = self.reqs[remote.removeprefix("p-")]
        for reply in replies:
            if isinstance(reply, PushResult):
                (req.landed if reply.ok else req.broken).add(rank)
        self.replies(replies)

    @rule(data=st.data(), again=st.booleans())
    def a_message_arrives(self, data: st.DataObject, again: bool) -> None:
        if not self.wire:
            return
        i = data.draw(st.integers(0, len(self.wire) - 1))
        self.deliver(*(self.wire[i] if again else self.wire.pop(i)))

    def deliver(self, direction: str, rank: int, message: ToPrefill | Reply) -> None:
        if not isinstance(message, PushResult | Problem):
            self.replies(self.prefill.receive(rank, message))
            return
        rid = message.request_id.removeprefix("p-")
        if rid not in self.active():
            return  # the shell drops word of a request already reported
        m = self.reqs[rid].machine
        self.run(rid, m.push_result(rank, message.ok, message.reason) if isinstance(message, PushResult)
                 else m.problem(rank, message.reason))

    @rule(data=st.data())
    def a_message_is_lost(self, data: st.DataObject) -> None:
        if self.wire:
            self.wire.pop(data.draw(st.integers(0, len(self.wire) - 1)))

    @rule(data=st.data(), now=SELDOM)
    def the_engine_aborts(self, data: st.DataObject, now: bool) -> None:
        if now and self.active():
            rid = data.draw(st.sampled_from(self.active()))
            self.run(rid, self.reqs[rid].machine.abort())

    @rule(rank=st.integers(0, 2), now=SELDOM)
    def a_prefill_rank_restarts(self, rank: int, now: bool) -> None:
        if now:
            self.prefill.restart(rank)

    @rule(dt=st.sampled_from([0.01, 0.1, 0.5, 0.5, 3.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for rid in self.active():
            self.run(rid, self.reqs[rid].machine.tick(self.now))

    @rule()
    def heartbeats_go_out(self) -> None:
        for rid in self.active():
            self.run(rid, list(self.reqs[rid].machine.heartbeat()))

    @rule()
    def the_engine_reset_completes(self) -> None:
        """The fence: every READ through this rank's engine ends failed, no WRITE in flight can land any more;
        then the requests that asked for it hear so."""
        if not self.fences:
            return
        for rid, req in list(self.reqs.items()):
            for rank in sorted(req.reads):
                req.reads.discard(rank)
                req.broken.add(rank)
                self.run(rid, req.machine.transfer_ended(rank, "engine reset"))
        self.prefill.decode_reset()
        fences, self.fences = self.fences, []
        for rid in fences:
            self.run(rid, self.reqs[rid].machine.fenced())

    # -- invariants -------------------------------------------------------------------------------------
    @invariant()
    def a_verdict_with_a_writer_out_is_draining(self) -> None:
        for rid in self.active():
            m = self.reqs[rid].machine
            if m.verdict is not None and self.writers(rid) and m.phase is not Phase.CONNECT:
                assert m.phase is Phase.DRAINING, f"{rid}: {m.verdict} in {m.phase} while {self.writers(rid)} write"

    def teardown(self) -> None:
        """Let every message through, every transfer end (one at a time) and the clock run: each request ends
        exactly once, and nothing is left."""
        for _ in range(200):
            if self.wire:
                self.deliver(*self.wire.pop(0))
            elif self.prefill.in_flight():
                remote, rank = sorted(self.prefill.in_flight())[0]
                self.a_write_ends_on_the_prefill_now(remote, rank, True)
            elif any(r.reads for r in self.reqs.values()):
                rid = next(rid for rid, r in sorted(self.reqs.items()) if r.reads)
                rank = min(self.reqs[rid].reads)
                self.reqs[rid].reads.discard(rank)
                self.reqs[rid].landed.add(rank)
                self.run(rid, self.reqs[rid].machine.transfer_ended(rank))
            elif self.fences:
                self.the_engine_reset_completes()
            elif self.waiting():
                rid, rank = self.waiting()[0]
                self.handshake_ends(rid, rank, "ready")
            elif self.active():
                self.time_passes(3.0)
            else:
                break
        for rid, req in self.reqs.items():
            assert len(req.reports) == 1, f"{rid} ended with {len(req.reports)} reports, in {req.machine.phase}"
            assert req.gives == 1, f"{rid}: staging given back {req.gives} times"
            assert req.machine.phase is Phase.REPORTED
        assert not self.fences and not self.prefill.in_flight() and not any(r.reads for r in self.reqs.values())


def _register(machine: DecodeRequest, rank: int) -> PushRegister:
    i = machine.ident
    return PushRegister(i.remote_request_id, i.engine_id, i.rank, i.tp_size, {0: [1, 2]}, 32, 0, 0, "boot-0", i.token)


World.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
test_each_decode_request_ends_once_and_never_while_a_writer_can_still_write = World.TestCase
