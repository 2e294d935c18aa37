"""What the worker half of the connector knows of each request it moves KV for: ``WorkerBook``, one record per
request, each with its phase.

A request KV comes in for (``Inbound``) is received from a prefill peer by the ``DecodeSide``, or loaded from
the host tier where vLLM waits for the load (several KV-cache groups); vLLM may abort it meanwhile, and then it
is reported as a delayed free once nothing lands in its blocks any more. A request KV goes out for
(``Outbound``) is handed to the ``PrefillSide`` under the transfer id the decode knows, or refused there, and is
reported sent once. The book is pure: no I/O, no clock, no lock (the worker's threads call it one at a time);
every change of phase is one of ``TRANSITIONS`` (``-``: no record), and a record leaves the book when its request
is reported, so an empty book is the leak check.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal


class Inbound(Enum):
    RECEIVING = "receiving"  # the DecodeSide receives into its blocks
    LOADING = "loading"  # a host-tier load vLLM waits for, reported like a receive
    ABORTED = "aborted"  # vLLM gave it up while KV may still land: reported as a delayed free once that ends


class Outbound(Enum):
    HANDED = "handed"  # the PrefillSide holds it under its transfer id
    REFUSED = "refused"  # the PrefillSide refused its end: reported sent at the next get_finished


TRANSITIONS: tuple[tuple[str, str, str], ...] = (
    ("-", "a receive started", "RECEIVING"),
    ("-", "a host-tier load vLLM waits for started", "LOADING"),
    ("RECEIVING", "vLLM aborted it", "ABORTED"),
    ("LOADING", "vLLM aborted it", "ABORTED"),
    ("RECEIVING", "it ended: reported received (ok or failed)", "-"),
    ("LOADING", "it ended: reported received (ok or failed)", "-"),
    ("ABORTED", "it ended: reported sent (vLLM frees the blocks then)", "-"),
    ("-", "handed to the PrefillSide", "HANDED"),
    ("HANDED", "handed again (a layer-wise request's end)", "HANDED"),
    ("HANDED", "the PrefillSide refused its end", "REFUSED"),
    ("HANDED", "the PrefillSide reported it: reported sent", "-"),
    ("REFUSED", "reported sent", "-"),
)
_ALLOWED = {(a, b) for a, _, b in TRANSITIONS}


@dataclass
class InRecord:
    phase: Inbound
    host: bool  # a host-tier load, not a DecodeSide receive
    short: bool = False  # a host-tier load that could not fill every block the lookup promised


@dataclass
class OutRecord:
    request_id: str  # vLLM's
    phase: Outbound = Outbound.HANDED


class WorkerBook:
    def __init__(self) -> None:
        self.inbound: dict[str, InRecord] = {}  # by vLLM's request id
        self.outbound: dict[str, OutRecord] = {}  # by the transfer id the decode knows

    # -- inbound ------------------------------------------------------------------------------------------
    def receiving(self, request_id: str) -> None:
        self._new_in(request_id, InRecord(Inbound.RECEIVING, host=False))

    def loading(self, request_id: str, short: bool) -> None:
        self._new_in(request_id, InRecord(Inbound.LOADING, host=True, short=short))

    def abort(self, request_id: str) -> bool:
        """vLLM aborted the request: whether a DecodeSide receive runs for it (to abort there too)."""
        record = self.inbound.get(request_id)
        if record is None or record.phase is Inbound.ABORTED:  # never started here, reported, or aborted already
            return False
        self._to(record, Inbound.ABORTED, request_id)
        return not record.host

    def awaits_receive(self, request_id: str) -> bool:
        """Whether the request's DecodeSide completion is awaited (a lookup: nothing is built per step)."""
        record = self.inbound.get(request_id)
        return record is not None and not record.host

    def load_short(self, request_id: str) -> bool | None:
        """For a host-tier load vLLM waits for: whether it is short; None for any other request."""
        record = self.inbound.get(request_id)
        return record.short if record is not None and record.host else None

    def ended(self, request_id: str) -> Literal["received", "sent"]:
        """Its completion is being reported: as a delayed free (``sent``) if vLLM aborted it, else as received
        (also for one that failed to start, which never had a record)."""
        record = self.inbound.pop(request_id, None)
        return "sent" if record is not None and record.phase is Inbound.ABORTED else "received"

    # -- outbound -----------------------------------------------------------------------------------------
    def handed(self, transfer_id: str, request_id: str) -> None:
        record = self.outbound.get(transfer_id)
        if record is not None and record.phase is Outbound.HANDED:
            record.request_id = request_id  # handed again (a layer-wise request's end)
        else:
            self.outbound[transfer_id] = OutRecord(request_id)

    def refused(self, transfer_id: str) -> None:
        """The PrefillSide refused the request's end: vLLM gets its blocks back at the next report."""
        record = self.outbound.get(transfer_id)
        if record is not None and record.phase is Outbound.HANDED:
            self._to(record, Outbound.REFUSED, record.request_id)

    def sent(self, transfer_id: str) -> str | None:
        """The PrefillSide reported the transfer: vLLM's request id, or None for an id not handed from here
        (a peer's stray or repeated completion, which vLLM would assert on)."""
        record = self.outbound.get(transfer_id)
        if record is None or record.phase is not Outbound.HANDED:
            return None
        del self.outbound[transfer_id]
        return record.request_id

    def take_refused(self) -> list[str]:
        refused = [tid for tid, r in self.outbound.items() if r.phase is Outbound.REFUSED]
        return [self.outbound.pop(tid).request_id for tid in refused]

    def transfer_id(self, request_id: str) -> str:
        """The transfer id the request was handed under (its own id if none)."""
        return next((t for t, r in self.outbound.items() if r.request_id == request_id), request_id)

    def held(self) -> dict[str, set[str]]:
        """Request ids with a record, by phase: all empty once every request was reported."""
        out: dict[str, set[str]] = {f"worker.{p.value}": set() for p in (*Inbound, *Outbound)}
        for rid, i in self.inbound.items():
            out[f"worker.{i.phase.value}"].add(rid)
        for o in self.outbound.values():
            out[f"worker.{o.phase.value}"].add(o.request_id)
        return out

    # -- rules --------------------------------------------------------------------------------------------
    def _new_in(self, request_id: str, record: InRecord) -> None:
        if request_id in self.inbound:  # one inbound transfer per request: the first one's completion counts
            return
        self.inbound[request_id] = record

    @staticmethod
    def _to(record: InRecord | OutRecord, phase: Inbound | Outbound, request_id: str) -> None:
        if (record.phase.name, phase.name) not in _ALLOWED:  # a bug in this file; the table is the contract
            raise RuntimeError(f"request {request_id}: {record.phase.name} -> {phase.name} is not in TRANSITIONS")
        record.phase = phase  # the table pairs each record with its own Enum
