"""Whether the proxy's index of one instance still follows that instance's KV-event stream: a state machine.

vLLM's ``ZmqEventPublisher`` numbers its batches 0, 1, 2... from its own start (``vllm/distributed/kv_events.py``,
``_seq_gen = count()``), keeps the last ``buffer_steps`` of them for a ROUTER replay socket, and sends nothing while
its engine caches nothing. So a subscriber sees: the next number (apply it), a number ahead (a gap: batches it
missed, which replay may fill), a number behind (the publisher restarted, or a duplicate: either way what the index
holds can no longer be trusted, and replay from 0 rebuilds it), or nothing for a while. A publisher that closes its
socket (its process ended; ZMQ tells the subscriber) is a restart too, seen before its new run's numbers come:
the stream starts over as ``FRESH``. Nothing is ambiguous only
while the router expects events: a prefill that had to cache new full blocks answered (``expect``) and no batch came
within the silence limit (``tick``): the instance is then ``SILENT``.

Only a ``SYNCED`` stream's index is used; in any other phase the router serves by load (``router.py``). Events are
the methods; each returns the actions for the shell (``kv_events.py``) to run: apply a batch to the index, ask for a
replay, forget the index. No I/O, no clock (``now`` comes in), no lock (the shell holds one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvplane.errors import KvplaneError
from kvplane.machines import transitions_table as _table


class Phase(Enum):
    FRESH = "fresh"  # no batch yet
    SYNCED = "synced"  # every batch applied in order since the publisher's first (or since a clear)
    REPLAYING = "replaying"  # a gap: replay asked from next_seq; live batches held until it ends
    SILENT = "silent"  # events were due (a prefill cached new blocks) and none came within the limit
    LOST = "lost"  # a gap replay could not fill, a batch not decodable: the index is cleared until a clear or restart


TRANSITIONS: frozenset[tuple[Phase, str, Phase]] = frozenset({
    (Phase.FRESH, "started", Phase.REPLAYING),
    (Phase.FRESH, "live", Phase.SYNCED), (Phase.FRESH, "live", Phase.REPLAYING), (Phase.FRESH, "live", Phase.LOST),
    (Phase.SYNCED, "live", Phase.SYNCED), (Phase.SYNCED, "live", Phase.REPLAYING), (Phase.SYNCED, "live", Phase.LOST),
    (Phase.SILENT, "live", Phase.SYNCED), (Phase.SILENT, "live", Phase.REPLAYING), (Phase.SILENT, "live", Phase.LOST),
    (Phase.LOST, "live", Phase.SYNCED), (Phase.LOST, "live", Phase.REPLAYING), (Phase.LOST, "live", Phase.LOST),
    (Phase.REPLAYING, "live", Phase.REPLAYING),
    (Phase.REPLAYING, "replayed", Phase.REPLAYING), (Phase.REPLAYING, "replayed", Phase.LOST),
    (Phase.REPLAYING, "replay_end", Phase.SYNCED), (Phase.REPLAYING, "replay_end", Phase.LOST),
    (Phase.REPLAYING, "replay_failed", Phase.LOST),
    (Phase.SYNCED, "tick", Phase.SILENT),
    (Phase.FRESH, "undecodable", Phase.LOST), (Phase.SYNCED, "undecodable", Phase.LOST),
    (Phase.SILENT, "undecodable", Phase.LOST), (Phase.REPLAYING, "undecodable", Phase.LOST),
    (Phase.LOST, "undecodable", Phase.LOST),
    *((phase, "disconnected", Phase.FRESH) for phase in Phase),
})


def transitions_table() -> str:
    """``TRANSITIONS`` as the markdown table docs/proxy.md carries (a unit test keeps the two equal)."""
    order = list(Phase)
    rows: list[tuple[Phase, str, Phase]] = sorted(TRANSITIONS, key=lambda t: (order.index(t[0]), t[1],
                                                                                order.index(t[2])))
    return _table(rows)


@dataclass(frozen=True)
class Apply:
    seq: int
    batch: Any  # the decoded batch, opaque here


@dataclass(frozen=True)
class Replay:
    start: int  # ask the replay socket for every batch from this number


@dataclass(frozen=True)
class Forget:
    why: str  # the index is no longer true: restart (a new hash seed may come) or lost (presence unknown)
    restart: bool


Action = Apply | Replay | Forget


@dataclass
class Stream:
    can_replay: bool
    silence_s: float
    phase: Phase = Phase.FRESH
    next_seq: int = 0  # the number the next live batch should carry
    held: list[tuple[int, Any]] = field(default_factory=list)  # live batches received while replaying
    due_since: float | None = None  # when a prefill that cached new blocks answered, no batch since

    def _to(self, phase: Phase, event: str) -> None:
        if (self.phase, event, phase) not in TRANSITIONS:
            raise KvplaneError(f"kv-event stream: no transition {self.phase.name} --{event}--> {phase.name}")
        self.phase = phase

    def started(self) -> list[Action]:
        """The subscription is open: with a replay socket, what the publisher sent before is asked at once (an
        empty answer: it has sent nothing, the instance has cached nothing)."""
        if self.phase is not Phase.FRESH or not self.can_replay:
            return []
        self._to(Phase.REPLAYING, "started")
        return [Replay(0)]

    def live(self, seq: int, batch: Any, clears: bool = False) -> list[Action]:
        """A batch from the PUB socket; ``clears``: it holds an ``AllBlocksCleared``."""
        if self.phase is Phase.REPLAYING:
            self.held.append((seq, batch))
            self._to(Phase.REPLAYING, "live")
            return []
        self.due_since = None
        behind = seq < self.next_seq and self.phase is not Phase.FRESH
        if behind:  # restarted (or a duplicate): rebuild from the publisher's buffer
            return [Forget(f"batch {seq} after {self.next_seq - 1}: the publisher restarted", True),
                    *self._catch_up(seq, batch, 0, "live")]
        if self.phase is Phase.LOST and not clears:
            self.next_seq = seq + 1
            self._to(Phase.LOST, "live")
            return []
        if seq == self.next_seq or (self.phase is Phase.LOST and clears):
            self.next_seq = seq + 1
            self._to(Phase.SYNCED, "live")
            return [Apply(seq, batch)]
        return self._catch_up(seq, batch, self.next_seq, "live")

    def _catch_up(self, seq: int, batch: Any, start: int, event: str) -> list[Action]:
        """Batches ``start`` to ``seq - 1`` are missing (``seq``'s batch is in hand): replay, or, seq 0 in hand
        without a replay socket, start over from it."""
        if self.can_replay:
            self.held = [(seq, batch)]
            self.next_seq = start
            self._to(Phase.REPLAYING, event)
            return [Replay(start)]
        self.next_seq = seq + 1
        if seq == start == 0:
            self._to(Phase.SYNCED, event)
            return [Apply(seq, batch)]
        self._to(Phase.LOST, event)
        return [Forget(f"batches {start} to {seq - 1} missed and no replay endpoint (kv_events_replay=)", False)]

    def replayed(self, seq: int, batch: Any) -> list[Action]:
        if self.phase is not Phase.REPLAYING or seq < self.next_seq:
            return []  # late or already applied
        if seq > self.next_seq:
            return self._lose("replayed", f"replay began at batch {seq}, {self.next_seq} was needed: the "
                                          f"publisher's buffer (buffer_steps) no longer holds it")
        self.next_seq = seq + 1
        self._to(Phase.REPLAYING, "replayed")
        return [Apply(seq, batch)]

    def replay_end(self) -> list[Action]:
        if self.phase is not Phase.REPLAYING:
            return []
        actions: list[Action] = []
        for seq, batch in self.held:
            if seq > self.next_seq:
                return self._lose("replay_end", f"batch {self.next_seq} is neither in the replay nor live")
            if seq == self.next_seq:
                actions.append(Apply(seq, batch))
                self.next_seq = seq + 1
        self.held = []
        self._to(Phase.SYNCED, "replay_end")
        return actions

    def replay_failed(self, why: str) -> list[Action]:
        return self._lose("replay_failed", why) if self.phase is Phase.REPLAYING else []

    def undecodable(self, seq: int, why: str) -> list[Action]:
        if self.phase is not Phase.REPLAYING:
            self.next_seq = seq + 1
        return self._lose("undecodable", f"batch {seq} could not be read: {why}")

    def disconnected(self) -> list[Action]:
        """The publisher's socket closed: whatever comes next is a new run, from its batch 0."""
        was = self.phase
        self.next_seq, self.held, self.due_since = 0, [], None
        self._to(Phase.FRESH, "disconnected")
        return [] if was is Phase.FRESH else [Forget("the publisher closed its socket (restarted or gone)", True)]

    def expect(self, now: float) -> None:
        """A prefill answered that cached new full blocks there: a batch is due."""
        if self.due_since is None:
            self.due_since = now

    def tick(self, now: float) -> bool:
        """True when the stream goes silent now."""
        if self.phase is Phase.SYNCED and self.due_since is not None and now - self.due_since > self.silence_s:
            self._to(Phase.SILENT, "tick")
            return True
        return False

    def _lose(self, event: str, why: str) -> list[Action]:
        self.held = []
        self._to(Phase.LOST, event)
        return [Forget(why, False)]
