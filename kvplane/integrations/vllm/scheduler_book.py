"""What the scheduler half of the connector knows of each request: one ``Tracked`` record per request, with
its phase and the facts the steps need (vLLM's request, its blocks, its hashes, what was stored, what vLLM's
prefix cache held), kept in ``SchedulerBook``.

A request is ``TRACKED`` from the first call that names it; a receive (or a load vLLM waits for) makes it
``RECEIVING`` until the workers report it; a layer-wise push makes it ``PUSHING``. Beside its phase, its record
says whether a host-tier lookup's hold is out for it (``holds``: the worker keeps the promised blocks until the
request's load, or a release the scheduler half sends when it is allocated without one or finishes); that hold
runs on its own clock, in any phase. When vLLM finishes it, its facts go and, if vLLM must delay the
free, it stays as ``ABORTING`` (its KV was still arriving) or ``SENDING`` (the workers send or drain it) until the
workers report it. Every change of phase is one of ``TRANSITIONS`` (``-``: no record); an empty book is the leak
check. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.integrations.vllm.metadata import Groups


class Phase(Enum):
    TRACKED = "tracked"  # known; nothing of its KV in flight
    RECEIVING = "receiving"  # a receive, or a host-tier load vLLM waits for, runs on the workers
    PUSHING = "pushing"  # prefill: its layer-wise push started
    ABORTING = "aborting"  # finished while its KV was arriving: vLLM delays the free until the workers report it
    SENDING = "sending"  # finished: the workers send its KV (or drain its push); vLLM delays the free


TRANSITIONS: tuple[tuple[str, str, str], ...] = (
    ("-", "a lookup, an allocation or a step names it", "TRACKED"),
    ("TRACKED", "a receive, or a load vLLM waits for, was queued", "RECEIVING"),
    ("RECEIVING", "the workers report it received (or it failed)", "TRACKED"),
    ("TRACKED", "its layer-wise push started", "PUSHING"),
    ("RECEIVING", "finished while its KV arrives", "ABORTING"),
    ("TRACKED", "finished: the workers send it", "SENDING"),
    ("PUSHING", "finished: the workers send it, or drain its push", "SENDING"),
    ("TRACKED", "finished with nothing in flight", "-"),
    ("PUSHING", "finished with nothing in flight", "-"),
    ("ABORTING", "the workers report it", "-"),
    ("SENDING", "the workers report it", "-"),
)
_ALLOWED = {(a, b) for a, _, b in TRANSITIONS}


@dataclass
class Tracked:
    phase: Phase = Phase.TRACKED
    request: Any = None  # vLLM's Request, from update_state_after_alloc
    block_ids: Groups | None = None  # per KV-cache group, as the steps scheduled them
    stored: dict[int, int] = field(default_factory=dict)  # blocks per group already handed to a store
    matched: int | None = None  # tokens vLLM's prefix cache held at the last lookup or remote count
    hashes: dict[int, list[int]] = field(default_factory=dict)  # chained block hashes per group, as ints
    holds: bool = False  # a lookup promised host blocks the worker holds for it, and no load was queued yet
    bad_token_logged: bool = False  # its malformed kvplane_token was logged
    params: TransferParams | None = None  # a remote prefill's kv_transfer_params, parsed where they entered
    refused: str = ""  # why those params cannot be this request's (they do not parse, or name a longer prompt)


class SchedulerBook:
    def __init__(self) -> None:
        self.records: dict[str, Tracked] = {}
        self.count: Counter[Phase] = Counter()  # records per phase, for vLLM's per-step questions

    def get(self, request_id: str) -> Tracked:
        """The request's record, made ``TRACKED`` on first use."""
        record = self.records.get(request_id)
        if record is None:
            record = self.records[request_id] = Tracked()
            self.count[Phase.TRACKED] += 1
        return record

    def to(self, request_id: str, phase: Phase) -> None:
        record = self.get(request_id)
        if (record.phase.name, phase.name) not in _ALLOWED:  # a bug in the scheduler half; the table is the contract
            raise RuntimeError(f"request {request_id}: {record.phase.name} -> {phase.name} is not in TRANSITIONS")
        self.count[record.phase] -= 1
        self.count[phase] += 1
        record.phase = phase

    def finish(self, request_id: str, delayed: Phase | None) -> None:
        """vLLM finished the request: its facts go; ``delayed`` (``ABORTING``, ``SENDING``) keeps it until the
        workers report it."""
        record = self.records.get(request_id)
        if delayed is not None:
            self.to(request_id, delayed)
            self.records[request_id] = Tracked(delayed)  # its facts go
            return
        if record is not None:
            if (record.phase.name, "-") not in _ALLOWED:
                raise RuntimeError(f"request {request_id}: {record.phase.name} -> - is not in TRANSITIONS")
            self._drop(request_id)

    def reported(self, request_id: str, phases: tuple[Phase, ...]) -> Phase | None:
        """The workers reported the request: a ``RECEIVING`` one is ``TRACKED`` again, an ``ABORTING`` or
        ``SENDING`` one leaves; its phase before, when it was one of ``phases``."""
        record = self.records.get(request_id)
        if record is None or record.phase not in phases:
            return None
        before = record.phase
        if before is Phase.RECEIVING:
            self.to(request_id, Phase.TRACKED)
        elif before in (Phase.ABORTING, Phase.SENDING):
            self._drop(request_id)
        return before

    def any_in(self, *phases: Phase) -> bool:
        return any(self.count[p] for p in phases)

    def _drop(self, request_id: str) -> None:
        self.count[self.records.pop(request_id).phase] -= 1

    def held(self) -> dict[str, set[str]]:
        """Request ids with a record, by phase, and those with a hold out: all empty once every request was
        finished and reported."""
        out: dict[str, set[str]] = {f"scheduler.{p.value}": set() for p in Phase}
        for rid, r in self.records.items():
            out[f"scheduler.{r.phase.value}"].add(rid)
        out["scheduler.holds"] = {rid for rid, r in self.records.items() if r.holds}
        return out
