"""The two request machines joined: decode ``DecodeRequest``s (driven as in ``test_decode_machine.World``) against
the real prefill ``HeldRequest``s, one per prefill rank and request, through the same lossy, repeating,
reordering channel, with the prefill engine handing requests over at any point (before or after the decode's
word), prefill ranks restarting, writes and reads ending well or badly, aborts, engine resets and time passing.

``RealPrefill`` carries the prefill machines' actions out as ``PrefillSide`` does (replies go back on the channel,
``Write``s become WRITEs in flight that the test ends), behind ``decode_world.PrefillRanks``.

Heartbeats are never lost here (they may come late or twice): the decode's timer renews a lease shorter than its
deadline, as ``heartbeat_s < lease_s`` does in a deployment, and a lease that outlives its renewals is a lost
connection, which the decode's deadline covers. Invariants, beyond the decode world's (exactly one report per decode request, none while a writer may still
land, ``done`` only with every rank's bytes landed):
- a READ counts as landed only if the prefill still held the blocks when it ended (else it read freed memory);
- a prefill machine never releases while one of its WRITEs is in flight, and releases exactly once;
- a pull the prefill released ``done`` is ``done`` on the decode too (its ReadDone said so);
- after the last request, every prefill machine ended, nothing is in flight, nothing is held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from decode_world import Reply
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_decode_machine import DEADLINE_S, World

from kvplane.flows.disagg.decode.decode_actions import ToPrefill
from kvplane.flows.disagg.prefill.held_request import (
    Action,
    Drop,
    HeldRequest,
    Prepare,
    Registered,
    Release,
    Send,
    Terms,
    Write,
)
from kvplane.flows.disagg.prefill.push_target import Target
from kvplane.flows.disagg.wire.messages import Cancel, Heartbeat, Problem, PushRegister, ReadDone
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.flows.disagg.wire.results import Completion
from kvplane.kv.manifest import Manifest

LEASE_S = 3.5  # shorter than the decode's deadline, longer than a step of the clock: heartbeats keep it
DECODE = b"decode-0"  # the decode rank's connection (routing id) on every prefill rank
LAYERS = ["layer.0", "layer.1"]


@dataclass
class InFlight:
    target: Target
    dead: bool = False  # the decode's engine was reset: this WRITE can no longer land


@dataclass
class Rank:
    """What one prefill rank has: its machines, its WRITEs in flight, its completions, its lifetime."""

    boot: int = 0
    machines: dict[str, HeldRequest] = field(default_factory=dict)
    writes: dict[str, list[InFlight]] = field(default_factory=dict)
    released: dict[str, list[Completion]] = field(default_factory=dict)


class RealPrefill:
    """Prefill ranks made of real ``HeldRequest`` machines, their actions carried out as ``PrefillSide`` does."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ranks: dict[int, Rank] = {}

    def rank(self, r: int) -> Rank:
        return self.ranks.setdefault(r, Rank())

    def machine(self, rid: str, r: int) -> HeldRequest:
        rank = self.rank(r)
        m = rank.machines.get(rid)
        if m is None:
            m = rank.machines[rid] = HeldRequest(rid, Terms(r, LEASE_S, DEADLINE_S),
                                                 deadline=self.clock() + DEADLINE_S)
        return m

    # -- the engine --------------------------------------------------------------------------------------
    def hand_over(self, rid: str, r: int) -> list[Reply]:
        """``request_finished`` on prefill rank ``r``, under the token the proxy gave both instances."""
        ids = {0: np.arange(4, dtype=np.int64)}
        return self.carry(rid, r, self.machine(rid, r).finish(ids, 64, "tok", self.clock()))

    def tick(self) -> list[Reply]:
        out: list[Reply] = []
        for r, rank in self.ranks.items():
            for rid, m in list(rank.machines.items()):
                out += self.carry(rid, r, m.tick(self.clock()))
        return out

    def carry(self, rid: str, r: int, actions: list[Action]) -> list[Reply]:
        rank, out = self.rank(r), []
        for a in actions:
            if isinstance(a, Send):
                assert a.to == DECODE, f"a reply to {a.to!r}, not the decode"
                out.append(a.message)
            elif isinstance(a, Write):
                rank.writes.setdefault(rid, []).append(InFlight(a.target))
            elif isinstance(a, Release):
                assert not rank.writes.get(rid), f"{rid} on rank {r} released with WRITEs in flight"
                rank.released.setdefault(rid, []).append(a.completion)
                del rank.machines[rid]
            elif isinstance(a, Drop):  # forgotten: later word about it starts afresh
                del rank.machines[rid]
            else:
                assert isinstance(a, Prepare | Registered)
        return out

    # -- decode_world.PrefillRanks -----------------------------------------------------------------------
    def receive(self, r: int, message: ToPrefill) -> list[Reply]:
        rank = self.rank(r)
        if isinstance(message, Heartbeat):
            out: list[Reply] = []
            for rid, token in dict(message.requests).items():
                m = rank.machines.get(rid)
                if m is not None:
                    out += self.carry(rid, r, m.heartbeat(message.engine_id, token, self.clock()))
                elif rid in rank.released and token == "tok":  # the shell answers with the outcome it remembers
                    out.append(Problem(rid, r, rank.released[rid][0].state))
            return out
        rid, key = message.request_id, (message.engine_id, message.rank)
        stale = isinstance(message, ReadDone | PushRegister) and message.expect_boot != f"boot-{rank.boot}"
        if stale:  # as PrefillSide checks the lifetime a message names before any machine sees it
            return [Problem(rid, r, "stale: this prefill rank restarted")]
        if rid in rank.released and rid not in rank.machines:  # the shell remembers released ids
            gone = Problem(rid, r, f"request is no longer held ({rank.released[rid][0].state})")
            return [gone] if isinstance(message, PushRegister) else []
        m = self.machine(rid, r)
        if isinstance(message, ReadDone):
            actions = m.read_done(DECODE, key, message.ok, message.tp_size, message.token)
        elif isinstance(message, PushRegister):
            peer = PeerRecord(message.engine_id, message.rank, message.tp_size, message.expect_boot,
                              cast(Manifest, None), "decode", DECODE)
            actions = m.register(DECODE, peer, message, list(LAYERS))
        else:
            assert isinstance(message, Cancel)
            actions = m.cancel(DECODE, key, message.token)
        return self.carry(rid, r, actions)

    def writing(self, request_id: str) -> set[int]:
        return {r for r, rank in self.ranks.items() if any(not w.dead for w in rank.writes.get(request_id, []))}

    def in_flight(self) -> list[tuple[str, int]]:
        return [(rid, r) for r, rank in self.ranks.items() for rid, ws in rank.writes.items() if ws]

    def write_ends(self, request_id: str, r: int, ok: bool) -> list[Reply]:
        rank = self.rank(r)
        w = rank.writes[request_id].pop(0)
        if not rank.writes[request_id]:
            del rank.writes[request_id]
        m = rank.machines.get(request_id)
        if m is None:
            return []
        landed = ok and not w.dead
        return self.carry(request_id, r, m.write_ended(w.target, "" if landed else "WRITE failed"))

    def decode_reset(self) -> None:
        for rank in self.ranks.values():
            for ws in rank.writes.values():
                for w in ws:
                    w.dead = True

    def restart(self, r: int) -> None:
        """The rank dies and comes back: its machines, WRITEs and blocks are gone with the process."""
        old = self.rank(r)
        self.ranks[r] = Rank(boot=old.boot + 1, released=old.released)  # no completion for what it held

    def freed(self, request_id: str, r: int) -> bool:
        """Whether rank ``r`` gave the request's blocks back to its engine (released it). Before the hand-over
        they are the engine's, computed and not freed: vLLM hands the proxy the parameters a step before its
        worker calls ``request_finished``, so a decode may read first."""
        return request_id in self.rank(r).released


class Joint(World):
    def __init__(self) -> None:
        super().__init__()
        self.real = RealPrefill(lambda: self.now)
        self.prefill = self.real
        self.unhanded: list[tuple[str, int]] = []
        self.handed: set[tuple[str, int]] = set()
        self.restarted: set[tuple[str, int]] = set()

    def a_request_arrives(self, mode: str, tp: int, plannable: bool) -> None:
        before = set(self.reqs)
        super().a_request_arrives(mode, tp, plannable)
        for rid in set(self.reqs) - before:
            self.unhanded += [(f"p-{rid}", r) for r in range(tp)]

    @rule(data=st.data())
    def the_prefill_engine_hands_a_request_over(self, data: st.DataObject) -> None:
        if self.unhanded:
            self.hand_over(*self.unhanded.pop(data.draw(st.integers(0, len(self.unhanded) - 1))))

    def hand_over(self, rid: str, r: int) -> None:
        if (rid, r) in self.restarted:
            return  # the engine that computed it is gone
        self.handed.add((rid, r))
        self.replies(self.real.hand_over(rid, r))

    @rule(data=st.data(), ok=st.booleans(), timed_out=st.booleans())
    def a_read_ends(self, data: st.DataObject, ok: bool, timed_out: bool) -> None:
        reads = [(rid, r) for rid, req in self.reqs.items() for r in req.reads]
        if reads:
            self.read_ends(*data.draw(st.sampled_from(sorted(reads))), ok, timed_out)

    def read_ends(self, rid: str, rank: int, ok: bool, timed_out: bool = False) -> None:
        req = self.reqs[rid]
        req.reads.discard(rank)
        gone = self.real.freed(f"p-{rid}", rank) or (f"p-{rid}", rank) in self.restarted
        covered = ok and not gone  # bytes read from blocks freed (or from a dead process) are garbage
        (req.landed if covered else req.broken).add(rank)
        self.run(rid, req.machine.transfer_ended(rank, "" if ok else "link down", timed_out))

    def a_prefill_rank_restarts(self, rank: int, now: bool) -> None:
        if now:
            self.restarted |= {(rid, r) for rid, r in self.handed | set(self.unhanded) if r == rank}
            self.real.restart(rank)

    def time_passes(self, dt: float) -> None:
        """The decode's heartbeat timer runs more often than the lease (heartbeat_s < lease_s): each request's
        heartbeat reaches the prefill ranks before the clock moves on."""
        for rid in self.active():
            for a in self.reqs[rid].machine.heartbeat():
                if self.reqs[rid].conns[a.rank].state == "ready":
                    self.deliver("to_prefill", a.rank, a.message)
        super().time_passes(dt)
        self.replies(self.real.tick())

    @rule(data=st.data())
    def a_message_is_lost(self, data: st.DataObject) -> None:
        """Any message but a heartbeat: a lease outliving its renewals is a connection lost, not a message."""
        lossy = [i for i, (_, _, m) in enumerate(self.wire) if not isinstance(m, Heartbeat)]
        if lossy:
            self.wire.pop(data.draw(st.sampled_from(lossy)))

    def teardown(self) -> None:
        while self.unhanded:
            self.hand_over(*self.unhanded.pop(0))
        for _ in range(200):
            if self.wire:
                self.deliver(*self.wire.pop(0))
            elif any(r.reads for r in self.reqs.values()):
                rid = next(rid for rid, r in sorted(self.reqs.items()) if r.reads)
                self.read_ends(rid, min(self.reqs[rid].reads), True)
            else:
                break
        super().teardown()
        for _ in range(400):  # the decode is done: let the prefill's word and leases run out
            if self.wire:
                self.deliver(*self.wire.pop(0))
            elif self.real.in_flight():
                rid, r = sorted(self.real.in_flight())[0]
                self.replies(self.real.write_ends(rid, r, True))
            elif any(rank.machines for rank in self.real.ranks.values()):
                self.time_passes(3.0)
            else:
                break
        for r, rank in self.real.ranks.items():
            assert not rank.machines, f"prefill rank {r} still holds {sorted(rank.machines)}"
            assert not rank.writes, f"prefill rank {r} still writes {sorted(rank.writes)}"
        for rid, r in self.handed - self.restarted:
            released = self.real.rank(r).released.get(rid, [])
            assert len(released) == 1, f"{rid} on prefill rank {r} released {len(released)} times: {released}"
            decode = self.reqs[rid.removeprefix("p-")]
            if released[0].state == "done" and decode.machine.ident.mode == "pull":
                assert decode.reports[0].state == "done", \
                    f"{rid}: the prefill released done, the decode reported {decode.reports[0]}"


Joint.TestCase.settings = settings(max_examples=1000, stateful_step_count=40, deadline=None)
test_the_two_request_machines_agree_over_a_lossy_channel = Joint.TestCase
