"""One request a decode rank receives, as a pure state machine: ``DecodeRequest``.

``DecodeSide`` (its I/O loop) keeps one machine per request, feeds it each event (its prefill connections'
readiness, the start's outcome, a transfer's end, a ``PushResult`` or ``Problem``, an abort, the clock, the
fence) and carries out the actions it returns (``decode_actions.py``). Nothing here does I/O, reads the clock
or logs: ``now`` is an argument, and what is worth logging comes back as a ``Note``.

The rule it enforces is the fence: a request is reported (its blocks go back to the engine) only once nothing
can write them: every transfer into them ended, or this rank's engine was reset. A verdict (failed, timed
out, aborted) that comes while a transfer may still write makes it ``DRAINING``; an end of a transfer that
comes after it was reported (a late ``PushResult``, a READ callback) is never applied. Every change of phase
is one of ``TRANSITIONS``, which docs/disagg.md lists (``transitions_table``, checked by a unit test).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from kvplane import machines
from kvplane.flows.disagg.decode.decode_actions import (
    ERROR,
    INFO,
    WARNING,
    Action,
    Fence,
    GiveStaging,
    MarkStale,
    Note,
    Relayout,
    Report,
    Send,
    Start,
)
from kvplane.flows.disagg.wire.messages import Cancel, Heartbeat, ReadDone
from kvplane.flows.disagg.wire.results import State


class Phase(Enum):
    CONNECT = "connect"  # handshakes with its prefill ranks, staging room; nothing can write its blocks yet
    MOVE = "move"  # READs (pull) or the prefill's WRITEs (push) may be running; no verdict yet
    DRAINING = "draining"  # a verdict is given, and a transfer may still write its blocks
    RELAYOUT = "relayout"  # every transfer ended ok; staged layers are being re-laid out (the shell, at once)
    REPORTED = "reported"  # its Completion is out: the blocks are the engine's


TRANSITIONS: tuple[tuple[Phase, str, Phase], ...] = (
    (Phase.CONNECT, "transfer started", Phase.MOVE),
    (Phase.CONNECT, "verdict (nothing was submitted)", Phase.REPORTED),
    (Phase.MOVE, "verdict, a writer still out", Phase.DRAINING),
    (Phase.MOVE, "every writer ended ok", Phase.RELAYOUT),
    (Phase.MOVE, "every writer ended, a verdict", Phase.REPORTED),
    (Phase.RELAYOUT, "re-laid out (or that failed)", Phase.REPORTED),
    (Phase.DRAINING, "every writer ended, or the engine fenced", Phase.REPORTED),
)
_ALLOWED = {(a, b) for a, _, b in TRANSITIONS}


def transitions_table() -> str:
    """The decode machine's transitions as the markdown table docs/disagg.md carries."""
    return machines.transitions_table(TRANSITIONS)


@dataclass(frozen=True)
class Ident:
    """What the machine puts in its messages and checks peers against (from ``kv_transfer_params`` and
    ``DisaggConfig``)."""

    request_id: str  # the decode engine's
    mode: Literal["pull", "push"]
    remote_request_id: str
    remote_engine_id: str
    remote_boot_id: str  # pull: the prefill lifetime that holds the KV
    token: str
    prefill_ranks: int  # the prefill instance's tp_size
    engine_id: str  # this decode instance
    rank: int
    tp_size: int
    drain_timeout_s: float


@dataclass(frozen=True)
class RankView:
    """What the shell knows of the connection to one prefill rank: ``state`` and, once handshaken, who it is."""

    state: Literal["waiting", "ready", "failed"]
    where: str  # host:port
    error: str = ""
    engine_id: str = ""  # "" until a handshake succeeded on it
    boot_id: str = ""


class DecodeRequest:
    def __init__(self, ident: Ident, deadline: float) -> None:
        self.ident = ident
        self.deadline = deadline
        self.phase = Phase.CONNECT
        self.pending: set[int] = set()  # prefill ranks whose transfer into the blocks may still write
        self.verdict: State | None = None
        self.reason = ""
        self.aborted = False
        self.drain_deadline: float | None = None  # set by the first tick that sees it draining
        self.fencing = False
        self.waiting_room = False
        self.boots: dict[int, str] = {}  # prefill rank -> its boot id, for ranks that handshook
        self.ready: set[int] = set()

    # -- events -------------------------------------------------------------------------------------------
    def connections(self, ranks: Mapping[int, RankView]) -> list[Action]:
        """The connections to its prefill ranks changed: start once all are ready and are the right peers."""
        self.boots.update({r: v.boot_id for r, v in ranks.items() if v.engine_id})
        self.ready = {r for r, v in ranks.items() if v.state == "ready"}
        if self.phase is not Phase.CONNECT or self.verdict is not None:
            return []
        failed = [(r, v) for r, v in sorted(ranks.items()) if v.state == "failed"]
        if failed:  # every prefill rank is told: the ones that handshook by ReadDone now, the others by a Cancel
            r, v = failed[0]
            self._decide("failed", f"handshake with prefill rank {r} at {v.where} failed: {v.error}")
            return self._give_up() + self._finish()
        if any(v.state != "ready" for v in ranks.values()):
            return []
        for r, v in sorted(ranks.items()):
            if v.engine_id != self.ident.remote_engine_id:
                return self._complete("failed", f"{v.where} is engine {v.engine_id!r}, but kv_transfer_params "
                                                f"name {self.ident.remote_engine_id!r}")
            if self.ident.mode == "pull" and v.boot_id != self.ident.remote_boot_id:
                return self._complete("failed", f"prefill rank {r} restarted since it finished this request; the "
                                                f"KV it held is gone (recompute it)")
        return [Start()]

    def started(self, ranks: Iterable[int]) -> list[Action]:
        """The transfers were submitted (pull: one READ per rank in ``ranks``) or registered (push)."""
        if self.phase is not Phase.CONNECT:
            return []
        self.waiting_room = False
        self._to(Phase.MOVE, "transfer started")
        self.pending = set(ranks)
        return self._finish() if not self.pending else []

    def no_room(self) -> list[Action]:
        """The staging arena is full for now: ``Start`` again on a later tick, until the deadline."""
        self.waiting_room = True
        return []

    def cannot_plan(self, reason: str) -> list[Action]:
        """The start failed before anything was submitted: tell the prefill ranks so they free at once."""
        self._decide("failed", f"cannot plan the transfer: {reason}")
        return self._give_up() + self._finish()

    def transfer_ended(self, rank: int, error: str = "", timed_out: bool = False, local: bool = False
                       ) -> list[Action]:
        """This rank's READ from prefill rank ``rank`` ended in the engine (``error`` empty: every byte landed).
        ``local``: the error is this rank's own (a staged chunk's re-layout), so the prefill rank's connection
        is kept as it is; a READ that failed may mean its engine was reset, so it is handshaken again."""
        if not self._writer_ended(rank):
            return [Note(WARNING, f"a READ of request {self.ident.request_id} from prefill rank {rank} ended after "
                                  f"the request was reported; dropped")]
        out: list[Action] = []
        if error and local:
            self._decide("failed", error)
        elif error:
            out.append(MarkStale(rank))
            self._decide("timed_out" if timed_out else "failed", f"READ from prefill rank {rank} failed: {error}")
        return out + (self._finish() if not self.pending else [])

    def push_result(self, rank: int, ok: bool, reason: str = "") -> list[Action]:
        """Prefill rank ``rank`` says its push into the blocks ended (its engine can no longer write them)."""
        if not self._counts():
            return [Note(INFO, f"PushResult for request {self.ident.request_id} came after it was reported; dropped")]
        if not self._writer_ended(rank):
            return [Note(INFO, f"a repeated PushResult for request {self.ident.request_id} from prefill rank "
                               f"{rank}; dropped")]
        if not ok:
            self._decide("failed", f"push from prefill rank {rank} failed: {reason}")
        return self._after_word()

    def problem(self, rank: int, reason: str) -> list[Action]:
        """Prefill rank ``rank`` could not act on a message about the request (it restarted, it let go)."""
        if not self._counts():
            return [Note(INFO, f"Problem for request {self.ident.request_id} came after it was reported; dropped")]
        self._decide("failed", f"prefill rank {rank}: {reason}")
        if self.ident.mode == "push" or self.phase is Phase.CONNECT:
            self.pending.discard(rank)  # it writes nothing for a request it does not know
        return self._after_word()

    def abort(self) -> list[Action]:
        """The engine gave the request up: stop, and report once nothing can write its blocks."""
        if self.phase in (Phase.REPORTED, Phase.RELAYOUT):
            return []
        self.aborted = True
        self._decide("failed", "aborted on the decode instance")
        if self.phase is Phase.CONNECT:
            return self._give_up() + self._finish()
        if self.ident.mode == "push" and self.phase is Phase.DRAINING:
            return self._cancel_push()
        return []

    def tick(self, now: float) -> list[Action]:
        """The clock: staging retries, the request's deadline, and the drain bound of a push."""
        if self.phase is Phase.CONNECT and now <= self.deadline and self.verdict is None:
            return [Start()] if self.waiting_room else []
        if self.phase is Phase.CONNECT:
            self._decide("timed_out", "the transfer did not start before the deadline (waiting for the handshake "
                                      "or for staging room)")
            return self._give_up() + self._finish()
        if self.phase is Phase.MOVE and now > self.deadline:
            self._decide("timed_out", "the KV did not arrive before the deadline")
            return self._cancel_push() if self.ident.mode == "push" else []
        if self.phase is Phase.DRAINING and self.ident.mode == "push":  # a pull's READs are fenced by the Mover
            if self.drain_deadline is None:
                self.drain_deadline = now + self.ident.drain_timeout_s
            elif now > self.drain_deadline and not self.fencing:
                self.fencing = True
                return [Fence(tuple(sorted(self.pending)), f"request {self.ident.request_id}: prefill ranks "
                              f"{sorted(self.pending)} did not confirm their writes ended within "
                              f"drain_timeout_s={self.ident.drain_timeout_s}")]
        return []

    def fenced(self) -> list[Action]:
        """This rank's engine was reset: no write of any transfer into the blocks can land any more."""
        self.fencing = False
        self.pending.clear()
        return self._finish() if self.phase is Phase.DRAINING else []

    def relaid_out(self, error: str = "") -> list[Action]:
        """The staged layers were re-laid out (``error``: that failed, so the blocks cannot be trusted)."""
        if self.phase is not Phase.RELAYOUT:
            return []
        if error:
            self.verdict, self.reason = "failed", f"re-layout of staged blocks failed: {error}"
        return self._report("re-laid out (or that failed)")

    def heartbeat(self) -> list[Send]:
        """One heartbeat entry per prefill rank while the request may still start or move (the shell merges
        them per connection and sends them to ready ones only)."""
        if self.phase not in (Phase.CONNECT, Phase.MOVE):
            return []
        i = self.ident
        return [Send(r, Heartbeat(i.engine_id, i.rank, [(i.remote_request_id, i.token)]), ready_only=True)
                for r in range(i.prefill_ranks)]

    # -- rules --------------------------------------------------------------------------------------------
    def _to(self, phase: Phase, why: str) -> None:
        if (self.phase, phase) not in _ALLOWED:  # a bug in this file; the transition table is the contract
            raise RuntimeError(f"decode request {self.ident.request_id}: {self.phase.name} -> {phase.name} ({why}) "
                               f"is not in TRANSITIONS")
        self.phase = phase

    def _counts(self) -> bool:
        """Whether the end of a transfer into the blocks still counts: not once the request was reported."""
        return self.phase in (Phase.CONNECT, Phase.MOVE, Phase.DRAINING)

    def _writer_ended(self, rank: int) -> bool:
        if not self._counts() or rank not in self.pending:
            return False
        self.pending.discard(rank)
        return True

    def _decide(self, state: State, reason: str) -> None:
        if self.verdict is None:
            self.verdict, self.reason = state, reason
        if self.phase is Phase.MOVE and self.pending:
            self._to(Phase.DRAINING, "verdict, a writer still out")

    def _after_word(self) -> list[Action]:
        if self.phase is Phase.CONNECT:
            return self._give_up() + self._finish() if self.verdict is not None else []
        return self._finish() if not self.pending else []

    def _finish(self) -> list[Action]:
        """Nothing moves into the blocks any more: re-lay out if all went well, tell the prefill, report."""
        if self.phase is Phase.REPORTED or self.pending:
            return [Note(ERROR, f"request {self.ident.request_id} asked to report in phase {self.phase.value} with "
                                f"prefill ranks {sorted(self.pending)} still writing; kept (a bug)")]
        if self.verdict is None:
            self._to(Phase.RELAYOUT, "every writer ended ok")
            return [Relayout()]
        why = {Phase.CONNECT: "verdict (nothing was submitted)", Phase.MOVE: "every writer ended, a verdict",
               Phase.DRAINING: "every writer ended, or the engine fenced"}[self.phase]
        return self._report(why)

    def _report(self, why: str) -> list[Action]:
        i = self.ident
        out: list[Action] = []
        if i.mode == "pull":
            out = [Send(r, ReadDone(i.remote_request_id, i.engine_id, i.rank, i.tp_size, self.verdict is None, boot,
                                    i.token)) for r, boot in sorted(self.boots.items())]
        self._to(Phase.REPORTED, why)
        return out + [GiveStaging(), Report(self.verdict or "done", self.reason)]

    def _complete(self, state: State, reason: str) -> list[Action]:
        """Reported before anything was asked of the prefill ranks, and none to tell: the peer at the address is
        another engine, or another lifetime of it (the KV went with the old one)."""
        self.verdict, self.reason = state, reason
        self._to(Phase.REPORTED, "verdict (nothing was submitted)")
        return [GiveStaging(), Report(state, reason)]

    def _cancel(self) -> Cancel:
        i = self.ident
        return Cancel(i.remote_request_id, i.engine_id, i.rank, i.token)

    def _cancel_push(self) -> list[Action]:
        """A verdict on a registered push: ask every rank still writing to stop (its ``PushResult`` confirms)."""
        return [Send(r, self._cancel()) for r in sorted(self.pending)]

    def _give_up(self) -> list[Action]:
        """A verdict in ``CONNECT`` (a deadline, a failed handshake, a plan that failed, an abort, a ``Problem``):
        nothing was asked of the prefill ranks yet, so each is told to free its blocks now rather than at its push
        timeout or lease: a push was not registered, so a ``Cancel`` goes to every rank; a pull's ranks that
        handshook get the report's ``ReadDone``, the others a ``Cancel``. At once where the connection is ready,
        else once a handshake with the rank succeeds (one still under way, or a later one: the shell retries)."""
        told = self.boots if self.ident.mode == "pull" else {}
        return [Send(r, self._cancel(), ready_only=True, later=True)
                for r in range(self.ident.prefill_ranks) if r not in told]
