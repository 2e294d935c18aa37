"""The world a decode request's machine lives in, for ``test_decode_machine.py``: a model of honest prefill ranks
behind a small interface (``PrefillRanks``), so the real prefill machine can take its place in a joint test.

``PrefillRanks`` is what the test needs of a prefill instance: it takes the decode's messages for a request
(``receive``), says which of its ranks may still write into the decode's blocks (``writing``), finishes a WRITE
in its engine (``write_ends``), loses every WRITE still in flight when the decode's engine is reset
(``decode_reset``), and restarts a rank (``restart``). Request ids are the prefill's (``Ident.remote_request_id``,
``"p-" + the decode's`` in the test). To run the real prefill machine in its place, write an adapter with these
methods around it and subclass ``test_decode_machine.World`` with ``make_prefill`` returning it. Replies (``PushResult``, ``Problem``) go back through the
test's channel, which loses, repeats and reorders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvplane.flows.disagg.decode.decode_actions import ToPrefill
from kvplane.flows.disagg.wire.messages import Cancel, Heartbeat, Problem, PushRegister, PushResult, ReadDone

Reply = PushResult | Problem


class PrefillRanks(Protocol):
    def receive(self, rank: int, message: ToPrefill) -> list[Reply]:
        """A decode message for one request reached prefill rank ``rank``; what it answers."""
        ...

    def writing(self, request_id: str) -> set[int]:
        """Ranks whose WRITE into the decode's blocks of ``request_id`` can still land."""
        ...

    def write_ends(self, request_id: str, rank: int, ok: bool) -> list[Reply]:
        """Rank ``rank``'s engine finished its WRITE for the request (``ok``: as far as that engine knows)."""
        ...

    def in_flight(self) -> list[tuple[str, int]]:
        """(request id, rank) of every WRITE still in a prefill engine, landing or not; ``write_ends`` ends one."""
        ...

    def decode_reset(self) -> None:
        """The decode's transfer engine was reset: no WRITE in flight can land in its memory any more."""
        ...

    def restart(self, rank: int) -> None:
        """Rank ``rank`` dies and comes back: its WRITEs stop, and it knows none of its requests any more."""
        ...


@dataclass
class _Held:
    state: str = "unknown"  # -> "writing" -> "done" | "cancelled"; "released" (pull: ReadDone)
    dead: bool = False  # its WRITE can no longer land (the decode's engine was reset): it ends failed
    cancelled_early: bool = False


@dataclass
class HonestPrefill:
    """Prefill ranks that follow the protocol: a push is written once registered, until it ends or is cancelled;
    a ``Cancel`` is answered once the WRITE stopped; a rank that restarted answers ``Problem``."""

    held: dict[tuple[str, int], _Held] = field(default_factory=dict)
    boot: dict[int, int] = field(default_factory=dict)  # rank -> restarts
    forgotten: set[tuple[str, int]] = field(default_factory=set)

    def receive(self, rank: int, message: ToPrefill) -> list[Reply]:
        if isinstance(message, Heartbeat):
            return []
        key = (message.request_id, rank)
        if key in self.forgotten:
            return [Problem(message.request_id, rank, "this prefill rank restarted; it holds nothing for it")]
        h = self.held.setdefault(key, _Held())
        if isinstance(message, PushRegister):
            if h.state == "unknown":
                h.state = "writing"
            elif h.state == "cancelled" and h.cancelled_early:
                return [PushResult(message.request_id, rank, False, "cancelled before the registration")]
        elif isinstance(message, Cancel):
            if h.state == "writing":  # the prefill fences its own WRITE first, then confirms
                h.state = "cancelled"
                return [PushResult(message.request_id, rank, False, "cancelled")]
            if h.state == "unknown":
                h.state, h.cancelled_early = "cancelled", True
        elif isinstance(message, ReadDone):
            h.state = "released"
        return []

    def writing(self, request_id: str) -> set[int]:
        return {r for (rid, r), h in self.held.items() if rid == request_id and h.state == "writing" and not h.dead}

    def write_ends(self, request_id: str, rank: int, ok: bool) -> list[Reply]:
        h = self.held.get((request_id, rank))
        if h is None or h.state != "writing":
            return []
        h.state = "done"
        landed = ok and not h.dead
        return [PushResult(request_id, rank, landed, "" if landed else "WRITE failed")]

    def in_flight(self) -> list[tuple[str, int]]:
        """Every WRITE still in a prefill engine (dead ones included: they end, failed)."""
        return [key for key, h in self.held.items() if h.state == "writing"]

    def decode_reset(self) -> None:
        for h in self.held.values():
            if h.state == "writing":
                h.dead = True

    def restart(self, rank: int) -> None:
        self.boot[rank] = self.boot.get(rank, 0) + 1
        for key in [k for k in self.held if k[1] == rank]:
            del self.held[key]
            self.forgotten.add(key)
