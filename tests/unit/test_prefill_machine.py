"""``HeldRequest`` machines (the prefill side of P/D) driven by hypothesis against a model decode instance, over
a channel that loses, reorders and duplicates messages, with a forging third party, aborts, lease expiries on a
fake clock, decode restarts, planning and write failures at any point.

The prefill shell here (``PrefillModel``) routes as ``PrefillSide`` does (early word makes a machine, released
ids are remembered) and carries the machines' actions out: ``Send`` onto the channel, ``Write`` into a list of
writes in flight that a rule ends, ok or failed, in any order. The decode instance sits behind ``DecodeModel``
(``ModelDecode`` here: honest TP ranks pulling and reading, or registering pushes, heartbeating, cancelling).

Invariants: each request is released at most once, and exactly once by the end; ``done`` only when every rank
of the owner decode instance read every layer while the blocks were held (pull) or received every layer it is
owed (push); a forged message (a wrong token, or another engine id) never changes what counts, never writes and
never releases; every phase change is one ``TRANSITIONS`` lists; nothing is left after the last request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvplane.flows.disagg.prefill.held_request import (
    TERMINAL,
    TRANSITIONS,
    Action,
    Drop,
    HeldRequest,
    Phase,
    Prepare,
    Registered,
    Release,
    Send,
    Terms,
    Write,
)
from kvplane.flows.disagg.prefill.push_target import Target
from kvplane.flows.disagg.wire.messages import Cancel, Heartbeat, Problem, PushRegister, PushResult, ReadDone
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.flows.disagg.wire.results import Completion
from kvplane.flows.disagg.wire.tokens import new_token
from kvplane.kv.manifest import Manifest

HONEST, FORGER = "decode", "evil"
LAYERS = ["l0", "l1", "l2"]
REQUESTS = ["r0", "r1"]
TERMS = Terms(rank=0, lease_s=10.0, push_timeout_s=5.0)
ToDecode = PushResult | Problem
ToPrefill = ReadDone | PushRegister | Cancel | Heartbeat


def peer(engine: str, rank: int, life: int) -> PeerRecord:
    identity = f"{engine}/{rank}/{life}".encode()
    return PeerRecord(engine, rank, 1, f"boot{life}", cast(Manifest, None), identity.decode(), identity)


# -- the decode instance, behind the interface a joint test plugs the real decode machine into ----------------
class DecodeModel(Protocol):
    """What the harness asks of a decode instance. Every method returns the messages its ranks send, as
    (rank, message); the harness puts them on the channel."""

    tp: int

    def begin(self, request_id: str, mode: str, token: str) -> None:
        """The proxy handed the request to decode (push: at once; pull: once the prefill issued its params)."""

    def step(self, request_id: str, rank: int, ok: bool, blocks_valid: bool) -> list[tuple[int, ToPrefill]]:
        """Rank ``rank`` makes its next move on the request: pull reads (``ok``: the read succeeded;
        ``blocks_valid``: the prefill still held the blocks as it read) then sends ``ReadDone``; push sends its
        ``PushRegister``."""

    def give_up(self, request_id: str, rank: int) -> list[tuple[int, ToPrefill]]:
        """Rank ``rank`` cancels its push (or declines it before registering)."""

    def heartbeat(self, rank: int) -> list[tuple[int, ToPrefill]]:
        """Rank ``rank`` renews the leases of the pulls it still waits on."""

    def receive(self, rank: int, message: ToDecode) -> list[tuple[int, ToPrefill]]:
        """A prefill's reply reached rank ``rank``."""

    def restart(self) -> None:
        """The decode instance restarted: it forgets every request (the prefill's leases end them)."""


@dataclass
class RankState:
    moved: bool = False  # read (pull) or registered (push)
    ended: bool = False


@dataclass
class ModelDecode:
    """Honest decode ranks: a pull rank reads once and says so; a push rank registers once and waits."""

    tp: int
    engine_id: str = HONEST
    requests: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (mode, token)
    ranks: dict[tuple[str, int], RankState] = field(default_factory=dict)
    reads: dict[tuple[str, int], bool] = field(default_factory=dict)  # valid successful reads (pull)

    def begin(self, request_id: str, mode: str, token: str) -> None:
        if request_id not in self.requests:
            self.requests[request_id] = (mode, token)
            for r in range(self.tp):
                self.ranks[(request_id, r)] = RankState()

    def step(self, request_id: str, rank: int, ok: bool, blocks_valid: bool) -> list[tuple[int, ToPrefill]]:
        state = self.ranks.get((request_id, rank))
        if state is None or state.moved or state.ended:
            return []
        state.moved = True
        mode, token = self.requests[request_id]
        if mode == "pull":
            self.reads[(request_id, rank)] = ok and blocks_valid
            return [(rank, ReadDone(request_id, self.engine_id, rank, self.tp, ok, "boot", token))]
        return [(rank, PushRegister(request_id, self.engine_id, rank, self.tp, {0: [rank]}, 16, 0, 0, "boot",
                                    token))]

    def give_up(self, request_id: str, rank: int) -> list[tuple[int, ToPrefill]]:
        state = self.ranks.get((request_id, rank))
        if state is None or state.ended or self.requests[request_id][0] == "pull":
            return []
        state.ended = True
        return [(rank, Cancel(request_id, self.engine_id, rank, self.requests[request_id][1]))]

    def heartbeat(self, rank: int) -> list[tuple[int, ToPrefill]]:
        pending = [(rid, token) for rid, (mode, token) in self.requests.items()
                   if mode == "pull" and not self.ranks[(rid, rank)].moved]
        return [(rank, Heartbeat(self.engine_id, rank, pending))] if pending else []

    def receive(self, rank: int, message: ToDecode) -> list[tuple[int, ToPrefill]]:
        state = self.ranks.get((message.request_id, rank))
        if state is not None and isinstance(message, PushResult):
            state.ended = True
        return []

    def restart(self) -> None:
        self.requests.clear()
        self.ranks.clear()


# -- the prefill shell, as PrefillSide routes ------------------------------------------------------------------
@dataclass
class InFlight:
    request: HeldRequest
    target: Target
    layers: tuple[str, ...]


class PrefillModel:
    def __init__(self) -> None:
        self.machines: dict[str, HeldRequest] = {}
        self.released: dict[str, str] = {}  # id -> token
        self.completions: dict[str, list[Completion]] = {}
        self.writes: list[InFlight] = []
        self.landed: dict[tuple[str, str, int], set[str]] = {}  # (request, engine, rank) -> layers written
        self.outbox: list[tuple[bytes, ToDecode]] = []
        self.plans_fail = False
        self.on_release: list[Any] = []
        self.transitions: set[tuple[Phase, str, Phase]] = set()  # every phase change any machine made
        self.honest: set[bytes] = set()  # connections the honest decode ranks handshook on

    def machine(self, request_id: str, deadline: float) -> HeldRequest | None:
        m = self.machines.get(request_id)
        if m is None and request_id not in self.released:
            m = self.machines[request_id] = HeldRequest(request_id, TERMS, deadline)
        return m

    def run(self, m: HeldRequest, actions: list[Action]) -> None:
        self.transitions.update(m.path)
        for a in actions:
            if isinstance(a, Send):
                self.outbox.append((a.to, a.message))
            elif isinstance(a, Prepare):
                if self.plans_fail:
                    self.run(m, m.plan_failed(a.target, "cannot plan the push: planted"))
                else:
                    a.target.plans = {}
            elif isinstance(a, Write):
                assert a.target.checked, "a write to a registration that does not count"
                if not a.whole and a.target.plans is None:  # as Pusher.write: its Prepare failed just before
                    self.run(m, m.write_ended(a.target, "cannot plan the push: its per-layer plans were not built"))
                else:
                    self.writes.append(InFlight(m, a.target, a.layers))
            elif isinstance(a, Release):
                for check in self.on_release:
                    check(m, a.completion)
                self.completions.setdefault(m.request_id, []).append(a.completion)
                self.released[m.request_id] = m.token
                del self.machines[m.request_id]
            elif isinstance(a, Drop):
                del self.machines[m.request_id]
            else:
                assert isinstance(a, Registered)

    def deliver(self, identity: bytes, message: ToPrefill, peer_record: PeerRecord, now: float) -> list[Action]:
        """One decode message, routed as ``PrefillSide._dispatch`` does; returns what the machine asked for."""
        if (message.engine_id == HONEST) != (identity in self.honest):
            return []  # Admission.sender: an engine id and rank count only on the connection they handshook on
        if isinstance(message, Heartbeat):
            out: list[Action] = []
            for rid, token in dict(message.requests).items():
                m = self.machines.get(rid)
                if m is not None:
                    out += self._go(m, m.heartbeat(message.engine_id, token, now))
            return out
        key = (message.engine_id, message.rank)
        if isinstance(message, ReadDone):
            m = self.machine(message.request_id, now + TERMS.lease_s)
            return [] if m is None else self._go(m, m.read_done(identity, key, message.ok, message.tp_size,
                                                                message.token))
        m = self.machine(message.request_id, now + TERMS.push_timeout_s)
        if m is None:
            return []
        if isinstance(message, PushRegister):
            return self._go(m, m.register(identity, peer_record, message, list(LAYERS)))
        return self._go(m, m.cancel(identity, key, message.token))

    def _go(self, m: HeldRequest, actions: list[Action]) -> list[Action]:
        self.run(m, actions)
        return actions


def snapshot(m: HeldRequest | None) -> object:
    """What counts in a machine: its phase, lease, owner, reads, decline, and the checked pushes."""
    if m is None:
        return None
    h = m.held
    targets = {k: (t.error, t.phase, frozenset(t.sent)) for k, t in h.targets.items() if t.checked}
    return (m.phase, m.deadline, h.owner, dict(h.readers), h.reader_tp, h.declined, targets, h.target_tp)


# -- the joint machine ------------------------------------------------------------------------------------------
class PrefillAgainstDecode(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.prefill = PrefillModel()
        self.prefill.on_release.append(self._check_release)
        self.decode: DecodeModel = ModelDecode(tp=1)
        self.life = 0
        self.peers: dict[int, PeerRecord] = {}
        self.to_prefill: list[tuple[int, int, ToPrefill]] = []  # (life, rank, message)
        self.modes: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.issued: set[str] = set()  # the engine finished it: its KV is valid until the completion
        self.started: set[str] = set()
        self.forger = peer(FORGER, 0, 0)

    @initialize(tp=st.sampled_from([1, 2]), modes=st.lists(st.sampled_from(["pull", "push", "layerwise"]),
                                                            min_size=len(REQUESTS), max_size=len(REQUESTS)))
    def setup(self, tp: int, modes: list[str]) -> None:
        self.decode = ModelDecode(tp=tp)
        self.peers = {r: peer(HONEST, r, 0) for r in range(tp)}
        self.prefill.honest = {p.identity for p in self.peers.values()}
        for rid, mode in zip(REQUESTS, modes, strict=True):
            self.modes[rid], self.tokens[rid] = mode, new_token()
            if mode != "pull":  # the proxy gives decode the push params before the prefill runs
                self.decode.begin(rid, mode, self.tokens[rid])

    # -- the prefill engine --------------------------------------------------------------------------------
    def _engine(self, rid: str, finish: bool) -> None:
        m = self.prefill.machine(rid, float("inf"))
        if m is None:
            return
        ids = {0: [1, 2]}
        actions = (m.finish(cast(Any, ids), 40, self.tokens[rid], self.now) if finish
                   else m.start(cast(Any, ids), 40, self.tokens[rid]))
        self.prefill.run(m, actions)

    @rule(rid=st.sampled_from(REQUESTS))
    def engine_starts(self, rid: str) -> None:
        if self.modes[rid] == "layerwise" and rid not in self.started and rid not in self.issued:
            self.started.add(rid)
            self._engine(rid, finish=False)

    @rule(rid=st.sampled_from(REQUESTS))
    def engine_finishes(self, rid: str) -> None:
        if rid in self.issued:
            return
        self.issued.add(rid)
        if self.modes[rid] == "pull":
            self.decode.begin(rid, "pull", self.tokens[rid])  # vLLM hands the proxy the params a step early
        else:
            self._engine(rid, finish=True)

    @rule(rid=st.sampled_from(REQUESTS))
    def worker_hands_pull_over(self, rid: str) -> None:
        if self.modes[rid] == "pull" and rid in self.issued and rid not in self.started:
            self.started.add(rid)
            self._engine(rid, finish=True)

    @rule(layer=st.sampled_from(LAYERS))
    def layer_saved(self, layer: str) -> None:
        for m in list(self.prefill.machines.values()):
            self.prefill.run(m, m.layer_saved(layer))

    @rule(rid=st.sampled_from(REQUESTS))
    def engine_aborts(self, rid: str) -> None:
        m = self.prefill.machines.get(rid)
        if m is not None:
            self.prefill.run(m, m.abort())

    @rule(i=st.integers(0, 7), ok=st.booleans())
    def write_ends(self, i: int, ok: bool) -> None:
        if not self.prefill.writes:
            return
        w = self.prefill.writes.pop(i % len(self.prefill.writes))
        if ok:
            key = (w.request.request_id, w.target.register.engine_id, w.target.register.rank)
            self.prefill.landed.setdefault(key, set()).update(w.layers)
        self.prefill.run(w.request, w.request.write_ended(w.target, "" if ok else "WRITE failed: planted"))

    @rule()
    def planning_breaks(self) -> None:
        self.prefill.plans_fail = not self.prefill.plans_fail

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 11.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for m in list(self.prefill.machines.values()):
            self.prefill.run(m, m.tick(self.now))

    # -- the decode instance and the channel -------------------------------------------------------------
    def _post(self, sent: list[tuple[int, ToPrefill]]) -> None:
        self.to_prefill += [(self.life, rank, message) for rank, message in sent]

    @rule(rid=st.sampled_from(REQUESTS), rank=st.integers(0, 1), ok=st.booleans())
    def decode_moves(self, rid: str, rank: int, ok: bool) -> None:
        if rank < self.decode.tp:
            valid = rid in self.issued and not self.prefill.completions.get(rid)
            self._post(self.decode.step(rid, rank, ok, valid))

    @rule(rid=st.sampled_from(REQUESTS), rank=st.integers(0, 1))
    def decode_gives_up(self, rid: str, rank: int) -> None:
        if rank < self.decode.tp:
            self._post(self.decode.give_up(rid, rank))

    @rule(rank=st.integers(0, 1))
    def decode_heartbeats(self, rank: int) -> None:
        if rank < self.decode.tp:
            self._post(self.decode.heartbeat(rank))

    @rule()
    def decode_restarts(self) -> None:
        self.decode.restart()
        old = self.peers
        self.life += 1
        self.peers = {r: peer(HONEST, r, self.life) for r in old}
        self.prefill.honest = {p.identity for p in self.peers.values()}
        for record in old.values():  # the new handshake replaced each rank's record: the shell forgets the old
            for m in list(self.prefill.machines.values()):
                self.prefill.run(m, m.peer_lost(record, "the decode instance restarted"))

    @precondition(lambda self: bool(self.to_prefill))
    @rule(i=st.integers(0, 15), keep=st.booleans())
    def deliver_to_prefill(self, i: int, keep: bool) -> None:
        """Any message in flight, not only the oldest; ``keep`` leaves a copy behind (a duplicate)."""
        life, rank, message = self.to_prefill[i % len(self.to_prefill)]
        if not keep:
            self.to_prefill.pop(i % len(self.to_prefill))
        if life != self.life:
            return  # its connection is gone with the old decode process
        self.prefill.deliver(self.peers[rank].identity, message, self.peers[rank], self.now)

    @precondition(lambda self: bool(self.to_prefill))
    @rule(i=st.integers(0, 15))
    def lose_to_prefill(self, i: int) -> None:
        self.to_prefill.pop(i % len(self.to_prefill))

    @precondition(lambda self: bool(self.prefill.outbox))
    @rule(i=st.integers(0, 15), lose=st.booleans())
    def deliver_to_decode(self, i: int, lose: bool) -> None:
        to, message = self.prefill.outbox.pop(i % len(self.prefill.outbox))
        rank = next((r for r, p in self.peers.items() if p.identity == to), None)
        if not lose and rank is not None:
            self._post(self.decode.receive(rank, message))

    # -- the forger ---------------------------------------------------------------------------------------
    @rule(rid=st.sampled_from(REQUESTS), kind=st.sampled_from(["read", "register", "cancel", "heartbeat"]),
          as_honest=st.booleans(), rank=st.integers(0, 1), ok=st.booleans(), late_token=st.booleans())
    def forger_sends(self, rid: str, kind: str, as_honest: bool, rank: int, ok: bool, late_token: bool) -> None:
        """A wrong token under any engine id, or the request's own token from another instance once the honest
        one owns the request (learning it before that is out of scope: the token is the pair's secret)."""
        m = self.prefill.machines.get(rid)
        engine, token = (HONEST if as_honest else FORGER), new_token()
        if late_token and not as_honest and m is not None and m.held.owner == HONEST:
            token = self.tokens[rid]
        message: ToPrefill
        if kind == "read":
            message = ReadDone(rid, engine, rank, 1, ok, "boot", token)
        elif kind == "register":
            message = PushRegister(rid, engine, rank, 1, {0: [9]}, 16, 0, 0, "boot", token)
        elif kind == "cancel":
            message = Cancel(rid, engine, rank, token)
        else:
            message = Heartbeat(engine, rank, [(rid, token)])
        before = snapshot(self.prefill.machines.get(rid))
        actions = self.prefill.deliver(self.forger.identity, message, self.forger, self.now + 1.0)
        assert not any(isinstance(a, Write | Prepare | Release | Drop) for a in actions), actions
        assert not any(isinstance(a, Send) and isinstance(a.message, PushResult) for a in actions), actions
        after = self.prefill.machines.get(rid)
        if before is not None:
            assert snapshot(after) == before, "a forged message changed what counts"

    # -- invariants ---------------------------------------------------------------------------------------
    def _check_release(self, m: HeldRequest, completion: Completion) -> None:
        rid = m.request_id
        event(f"{self.modes[rid]} tp={self.decode.tp} {completion.state}")
        assert not self.prefill.completions.get(rid), f"{rid} released twice"
        assert rid in self.issued or rid in self.started, f"{rid} released before the engine handed it over"
        if not completion.ok:
            return
        owner, tp = m.held.owner, self.decode.tp
        assert owner == HONEST, f"{rid} done for {owner!r}"
        for rank in range(tp):
            if self.modes[rid] == "pull":
                assert (HONEST, rank) in m.held.readers, f"{rid} done without rank {rank}'s ReadDone"
                assert cast(ModelDecode, self.decode).reads.get((rid, rank)), (
                    f"{rid} done, rank {rank} did not read it whole while it was held")
            else:
                landed = self.prefill.landed.get((rid, HONEST, rank), set())
                assert set(LAYERS) <= landed, f"{rid} done, rank {rank} received only {sorted(landed)}"

    @invariant()
    def transitions_are_the_declared_ones(self) -> None:
        for m in self.prefill.machines.values():
            self.prefill.transitions.update(m.path)
        assert self.prefill.transitions <= TRANSITIONS, self.prefill.transitions - TRANSITIONS

    @invariant()
    def the_forger_never_counts(self) -> None:
        for m in self.prefill.machines.values():
            assert m.held.owner in ("", HONEST)
            assert all(engine == HONEST for engine, _ in m.held.readers)
            assert all(t.register.engine_id == HONEST for t in m.targets.values() if t.checked)

    def teardown(self) -> None:
        """The last request: the engine finishes, the decode ranks make their moves, every message arrives,
        every write ends, leases run out."""
        if not self.modes:
            return
        for rid in REQUESTS:
            self.engine_finishes(rid)
            for rank in range(self.decode.tp):
                self.decode_moves(rid, rank, True)
            self.worker_hands_pull_over(rid)
        for _ in range(20):
            while self.prefill.writes:
                self.write_ends(0, True)
            while self.to_prefill:
                self.deliver_to_prefill(0, False)
            while self.prefill.outbox:
                self.deliver_to_decode(0, False)
        self.time_passes(100.0)
        while self.prefill.writes:
            self.write_ends(0, True)
        self.time_passes(100.0)
        assert not self.prefill.machines, {r: m.phase for r, m in self.prefill.machines.items()}
        assert not self.prefill.writes
        for rid in REQUESTS:
            assert len(self.prefill.completions.get(rid, [])) == 1, (rid, self.prefill.completions.get(rid))
        self.transitions_are_the_declared_ones()
        assert all(m.phase in TERMINAL for m in self.prefill.machines.values())


TestPrefillAgainstDecode = PrefillAgainstDecode.TestCase
TestPrefillAgainstDecode.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
