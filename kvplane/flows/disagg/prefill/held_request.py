"""``HeldRequest``: one request on a prefill rank as a pure state machine, from the first word about it to its
one ``Completion``.

``PrefillSide`` (the shell) feeds it one event per call: the engine handed the request over (``start``,
``finish``), a layer was saved, the engine aborted it, a decode rank's ``ReadDone``/``PushRegister``/``Cancel``/
``Heartbeat``, a write to a target ended, a peer was forgotten, ``tick(now)``. Each call returns the actions the
shell carries out, in order (``held_actions.py``): ``Send`` a message to a peer, ``Prepare`` the per-layer plans of a target,
``Write`` layers to a target (the shell's ``Pusher`` plans and hands them to the transfer thread, and calls
``write_ended`` once they landed), ``Registered`` (a push registration stands), ``Release`` with the request's
``Completion``, or ``Drop`` (word about a request the engine never handed over expired). No I/O and no clock
read in here: the time is an argument.

Whose word counts is ``ownership.py``'s rules on the ``Held`` record this machine keeps. The machine releases
a request once nothing more can happen to its blocks: exactly once, ``done`` only when every decode rank of the
owner instance read or received every layer this rank owes it. ``TRANSITIONS`` (``held_phases.py``) lists every
phase change the machine makes; docs/disagg.md draws it (``render_transitions``) and a unit test checks both
agree; a change the table does not list raises (a bug here, never a peer's doing). The actions and phases are
re-exported here, so the machine's users import them from this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.blocks.groups import Ids
from kvplane.flows.disagg.prefill import ownership
from kvplane.flows.disagg.prefill.held_actions import Action, Drop, Prepare, Registered, Release, Send, Write
from kvplane.flows.disagg.prefill.held_phases import TERMINAL, TRANSITIONS, Phase, render_transitions
from kvplane.flows.disagg.prefill.held_record import Held
from kvplane.flows.disagg.prefill.push_target import Target, TargetPhase
from kvplane.flows.disagg.wire.messages import Problem, PushRegister, PushResult
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.flows.disagg.wire.results import Completion, State
from kvplane.flows.disagg.wire.tokens import same_token

__all__ = ["TERMINAL", "TRANSITIONS", "WRITES_PER_TARGET", "Action", "Drop", "HeldRequest", "Key", "Phase",
           "Prepare", "Registered", "Release", "Send", "Terms", "Write", "render_transitions"]

Key = ownership.Key
# layer-wise push: writes in flight to one decode rank; layers saved meanwhile leave together when one ends
WRITES_PER_TARGET = 2


@dataclass(frozen=True)
class Terms:
    """What the machine needs of the side's config."""

    rank: int  # this prefill rank, named in its replies
    lease_s: float  # a finished request is held this long past its last heartbeat
    push_timeout_s: float  # word about a request not handed over yet is kept this long


@dataclass
class HeldRequest:
    request_id: str
    terms: Terms
    deadline: float = float("inf")  # of the lease, or of the wait for the engine to hand the request over
    held: Held = field(init=False)  # the record, its phase included
    path: list[tuple[Phase, str, Phase]] = field(default_factory=list)  # the transitions taken, in order

    def __post_init__(self) -> None:
        self.held = Held(self.request_id)

    @property
    def phase(self) -> Phase:
        return self.held.phase

    @property
    def token(self) -> str:
        return self.held.token

    @property
    def targets(self) -> dict[Key, Target]:
        return self.held.targets

    @property
    def in_flight(self) -> bool:
        return any(t.inflight for t in self.held.targets.values())

    # -- engine events --------------------------------------------------------------------------------------
    def start(self, block_ids: dict[int, Ids], num_tokens: int, token: str) -> list[Action]:
        """``start_request``: the coming forward completes the prompt in ``block_ids`` (again, after a
        preemption: the new blocks count)."""
        if self.phase not in (Phase.EARLY, Phase.COMPUTING):
            return []
        self._go("start", Phase.COMPUTING)
        return self._event("start", self._hand_over(block_ids, num_tokens, token, None))

    def finish(self, block_ids: dict[int, Ids], num_tokens: int, token: str, now: float) -> list[Action]:
        """``request_finished``: the KV is computed; hold it under a lease from ``now``."""
        if self.phase not in (Phase.EARLY, Phase.COMPUTING, Phase.HELD):
            return []
        self._go("finish", Phase.HELD)
        return self._event("finish", self._hand_over(block_ids, num_tokens, token, now))

    def layer_saved(self, layer: str) -> list[Action]:
        held = self.held
        if self.phase is not Phase.COMPUTING:
            return []
        held.saved.add(layer)
        out: list[Action] = []
        for target in held.targets.values():
            if layer in target.layers:
                out += self._write(target)
        return self._event("layer_saved", out)

    def abort(self) -> list[Action]:
        """The engine aborted it; finished KV stays valid for decode (the lease or the readers end it)."""
        if self.phase is not Phase.COMPUTING:
            return []
        self._go("abort", Phase.ABORTED)
        return self._event("abort", [])

    # -- decode ranks' messages (the shell checked the boot id and that the sender handshook) ---------------
    def read_done(self, sender: bytes, key: Key, ok: bool, tp_size: int, token: str) -> list[Action]:
        if self.phase in TERMINAL:
            return []
        if not ownership.read_done(self.held, key, ok, tp_size, token):
            return [self._problem(sender, "ReadDone does not carry this request's token (or comes from another "
                                          "decode instance); ignored")]
        return self._event("read_done", [])

    def register(self, sender: bytes, peer: PeerRecord, reg: PushRegister, layers: list[str]) -> list[Action]:
        """A push registration of ``peer`` (its destination checked by the shell), owed ``layers`` by this rank."""
        held = self.held
        if self.phase in TERMINAL:
            return []
        if not ownership.may_register(held, reg.engine_id, reg.token):
            return [self._problem(sender, "the push registration's token does not match the request's")]
        previous = held.targets.get((reg.engine_id, reg.rank))
        if previous is not None and not previous.reported:  # never replace a standing target: its WRITE may run
            if reg == previous.register:
                return []  # the same registration again: it stands already
            previous.error = previous.error or "registered twice, with another destination, while the first stood"
            return self._event("register", [self._problem(sender, previous.error)])
        target = Target(peer, reg, layers, TargetPhase.CHECKED if held.known else TargetPhase.UNCHECKED)
        if held.known:
            held.target_tp = reg.tp_size
        held.targets[(reg.engine_id, reg.rank)] = target
        out: list[Action] = [Registered()]
        if held.phase is Phase.HELD:
            out += self._push_rest(target)
        elif held.block_ids is not None:
            out += self._prepare(target)
            out += self._write(target)
        return self._event("register", out)

    def cancel(self, sender: bytes, key: Key, token: str) -> list[Action]:
        """A decode rank cancelled its push, or gave it up before registering (it could not plan it)."""
        if self.phase in TERMINAL:
            return []
        target = self.held.targets.get(key)
        if target is None:
            if not ownership.decline(self.held, key, token):
                return [self._problem(sender, "Cancel does not carry this request's token (or comes from another "
                                              "decode instance); ignored")]
            return self._event("cancel", [])
        if not same_token(target.register.token, token):
            return []
        target.error = target.error or "cancelled by the decode rank"  # nothing more is written to it
        return self._event("cancel", [])

    def heartbeat(self, engine_id: str, token: str, now: float) -> list[Action]:
        """A decode rank still wants the finished request: renew its lease from ``now``."""
        if self.phase is Phase.HELD and ownership.owned(self.held, engine_id, token):
            self.deadline = now + self.terms.lease_s
        return []

    # -- the shell's results --------------------------------------------------------------------------------
    def write_ended(self, target: Target, error: str) -> list[Action]:
        """A ``Write`` to ``target`` ended: ``error`` says why it failed ("" when its bytes landed)."""
        target.inflight -= 1
        if self.phase in TERMINAL:
            return []
        if error and not target.error:
            target.error = error
        return self._event("write_ended", self._write(target))

    def plan_failed(self, target: Target, reason: str) -> list[Action]:
        """A ``Prepare`` of ``target`` failed: nothing will be written to it."""
        if self.phase in TERMINAL:
            return []
        target.error = target.error or reason
        return self._event("plan_failed", [])

    def peer_lost(self, peer: PeerRecord, why: str) -> list[Action]:
        """The shell forgot ``peer`` (it restarted, or its transport went): its pushes fail."""
        if self.phase in TERMINAL:
            return []
        for target in self.held.targets.values():
            if target.peer is peer and not target.reported:
                target.error = target.error or why
        return self._event("peer_lost", [])

    def tick(self, now: float) -> list[Action]:
        """Expire the lease (or the wait for the engine) once ``deadline`` passed and no write is in flight."""
        if self.phase in TERMINAL or self.deadline >= now or self.in_flight:
            return []
        return self._event("tick", self._expire("tick"))

    # -- inside ---------------------------------------------------------------------------------------------
    def _go(self, event: str, new: Phase) -> None:
        """Move to ``new`` on ``event``; a change ``TRANSITIONS`` does not list raises (a bug in this file)."""
        old = self.held.phase
        if new is old:
            return
        if (old, event, new) not in TRANSITIONS:
            raise RuntimeError(f"prefill request {self.request_id}: {old.name} -> {new.name} on {event!r} "
                               f"is not in TRANSITIONS")
        self.path.append((old, event, new))
        self.held.phase = new

    def _event(self, event: str, out: list[Action]) -> list[Action]:
        """After ``event`` changed the record (its actions ``out``): report what ended, release once nothing more
        can happen to the request's blocks."""
        if self.phase not in TERMINAL:
            out += self._settle(event)
        return out

    def _hand_over(self, block_ids: dict[int, Ids], num_tokens: int, token: str, now: float | None
                   ) -> list[Action]:
        held = self.held
        held.block_ids, held.num_tokens = block_ids, num_tokens
        out: list[Action] = [
            self._problem(refused.peer.identity, "the push registration's token does not match the request's; "
                                                 "register with the kv_transfer_params of this request")
            for refused in ownership.hand_over(held, token)  # word that came before counts only with the token
        ]
        if now is not None:
            self.deadline = now + self.terms.lease_s
            for target in held.targets.values():
                out += self._push_rest(target)
        else:  # computing: only finish or abort ends it now, not the early word's deadline (its forward writes)
            self.deadline = float("inf")
            for target in held.targets.values():
                out += self._prepare(target)
        return out

    def _source_ok(self, target: Target) -> bool:
        """Whether a push to ``target`` can be planned: its registration was checked and expects no more tokens
        than this prefill computed."""
        if target.error or self.held.block_ids is None or not target.checked:
            return False
        if target.register.num_tokens > self.held.num_tokens:
            target.error = (f"decode expects {target.register.num_tokens} tokens, this prefill computed "
                            f"{self.held.num_tokens}; both must count the same prompt")
            return False
        return True

    def _stopped(self) -> bool:
        return self.held.phase is Phase.ABORTED or bool(self.held.declined)

    def _prepare(self, target: Target) -> list[Action]:
        if target.phase is not TargetPhase.CHECKED or not self._source_ok(target):
            return []
        target.to(TargetPhase.STREAMING)
        return [Prepare(target)]

    def _write(self, target: Target) -> list[Action]:
        """Write ``target``'s layers that are ready (saved, or every one once the request finished) and not sent.

        With ``WRITES_PER_TARGET`` writes to it in flight, ready layers wait, and leave together when one ends:
        a push that falls behind the prefill catches up with fewer, bigger writes (over a cross-layer cache,
        one descriptor per block for all the layers of a write) instead of a queue of one-layer writes."""
        if (target.phase is not TargetPhase.STREAMING or target.error or self._stopped()
                or target.inflight >= WRITES_PER_TARGET):
            return []
        held = self.held
        finished = held.phase is Phase.HELD
        todo = tuple(x for x in target.layers if x not in target.sent and (finished or x in held.saved))
        if not todo:
            return []
        target.sent.update(todo)
        target.inflight += 1
        return [Write(target, todo, whole=False)]

    def _push_rest(self, target: Target) -> list[Action]:
        """The request is finished: write every layer not yet sent. When none was (a whole-request push) and
        nothing is staged, one plan covers all layers."""
        if not target.sent and target.phase is TargetPhase.CHECKED and not target.register.staging_addr:
            if not self._source_ok(target) or self._stopped():
                return []
            target.sent.update(target.layers)
            target.inflight += 1
            return [Write(target, tuple(target.layers), whole=True)]
        return self._prepare(target) + self._write(target)

    def _problem(self, to: bytes, reason: str) -> Send:
        return Send(to, Problem(self.request_id, self.terms.rank, reason))

    def _result(self, target: Target, ok: bool, reason: str) -> Send:
        return Send(target.peer.identity, PushResult(self.request_id, self.terms.rank, ok, reason))

    def _settle(self, event: str) -> list[Action]:
        """Report finished pushes, and release the request once nothing more can happen to its blocks."""
        held = self.held
        finished, aborted = held.phase is Phase.HELD, held.phase is Phase.ABORTED
        out: list[Action] = []
        for target in held.targets.values():
            if target.reported or target.inflight or not target.checked:
                continue
            complete = finished and set(target.layers) <= target.sent
            if held.declined:  # one decode rank gave the request up: nothing more is written to any of them
                target.error = target.error or held.declined
            if target.error or aborted or complete or not target.layers:
                reason = target.error or ("aborted on the prefill instance" if aborted else "")
                out.append(self._result(target, not reason and (complete or not target.layers), reason))
                target.to(TargetPhase.REPORTED)
        if self.in_flight or not (finished or aborted):
            return out
        if aborted:
            return out + self._release(event, "failed", "aborted before its prefill finished")
        if held.declined:
            return out + self._release(event, "failed", held.declined)
        if held.reader_tp and len(held.readers) >= held.reader_tp:
            failed = [k for k, ok in held.readers.items() if not ok]
            if failed:
                return out + self._release(event, "failed", f"decode rank(s) {failed} reported the read failed")
            return out + self._release(event, "done")
        if held.target_tp and len(held.targets) >= held.target_tp and all(t.reported for t in held.targets.values()):
            errors = [t.error for t in held.targets.values() if t.error]
            return out + self._release(event, "failed" if errors else "done", "; ".join(errors))
        return out

    def _release(self, event: str, state: State, reason: str = "") -> list[Action]:
        self._go(event, Phase.RELEASED)
        return [Release(Completion(self.request_id, state, reason=reason))]

    def _expire(self, event: str) -> list[Action]:
        held = self.held
        out: list[Action] = []
        if not held.known:  # word of a request that never came here: nothing of the engine's is held
            self._go(event, Phase.DROPPED)
            for t in held.targets.values():
                if not t.reported:
                    out.append(self._result(t, False, "the prefill instance never saw this request"))
                    t.to(TargetPhase.REPORTED)
            return out + [Drop()]
        for target in held.targets.values():
            if not target.reported:
                target.error = target.error or "lease expired before the push completed"
                out.append(self._result(target, False, target.error))
                target.to(TargetPhase.REPORTED)
        return out + self._release(event, "timed_out", f"lease of {self.terms.lease_s} s expired without the decode "
                                                f"finishing")
