"""Bounds on what a peer's messages can make a side do: replies and log lines per second, records kept for
requests the engine has not handed over yet (per decode connection, and in total with a floor for every
connection: ``MAX_EARLY_PER_PEER``, ``MAX_EARLY``, ``EARLY_FLOOR``).

A flood of messages that each earn an answer (thousands of ``ReadDone`` for a previous boot, registrations
with a wrong token) costs at most ``RateLimit``'s budget in ``Problem`` replies per decode connection
(``PerPeer``): one peer's flood spends its own budget, never another's. A ``Problem`` answering a message that
carried the request's token is not limited at all: only the decode that owns the request can earn it, once
per request a message names, and dropping it would leave that decode waiting for its deadline (then draining
and resetting its engine). Warnings have a budget of their own, so a burst of log lines never eats the
replies'. What is dropped is counted, and the count is logged once the budget refills.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

MAX_EARLY = 4096  # requests a prefill rank keeps word of before the engine hands them over (all peers)
# ... of which one decode connection may have made at most MAX_EARLY_PER_PEER; and once MAX_EARLY are kept, a
# connection that made fewer than EARLY_FLOOR still may: a flood from some peers never refuses another's requests
MAX_EARLY_PER_PEER = 256
EARLY_FLOOR = 16
REPLIES_PER_S = 200.0  # problem replies per second per decode connection, warnings per side (burst: as many)
MAX_PEERS = 1024  # decode connections whose reply budget is kept (the least recently used one goes first)
MAX_DECLINES = 4096  # declines a decode rank keeps for one prefill rank not connected yet (the oldest go first)
MAX_DECLINE_PEERS = 256  # prefill ranks a decode rank keeps declines for (the least recently declined to goes first)
MAX_PREFILL_TP = 256  # prefill ranks one kv_transfer_params may name: a decode rank opens a socket to each


class RateLimit:
    """A token bucket: ``allow()`` is True at most ``per_s`` times a second (with a burst of as many)."""

    def __init__(self, per_s: float = REPLIES_PER_S) -> None:
        self.per_s = per_s
        self._tokens = per_s
        self._last = time.monotonic()
        self.dropped = 0

    def allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.per_s, self._tokens + (now - self._last) * self.per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.dropped += 1
        return False

    def warn(self, logger: logging.Logger, message: str, *args: object) -> None:
        """Log a warning within the budget; once the budget allows again, say how many were suppressed."""
        if not self.allow():
            return
        if self.dropped:
            logger.warning("(%d similar replies or warnings suppressed by the rate limit)", self.dropped)
            self.dropped = 0
        logger.warning(message, *args)


class PerPeer:
    """One ``RateLimit`` per peer connection (a ZMQ routing id), for at most ``MAX_PEERS`` connections: a peer
    seen again after its budget was forgotten starts with a full one, as a new connection would."""

    def __init__(self, per_s: float = REPLIES_PER_S, peers: int = MAX_PEERS) -> None:
        self.per_s, self.peers = per_s, peers
        self._limits: OrderedDict[bytes, RateLimit] = OrderedDict()

    def allow(self, peer: bytes) -> bool:
        limit = self._limits.get(peer)
        if limit is None:
            limit = self._limits[peer] = RateLimit(self.per_s)
            while len(self._limits) > self.peers:
                self._limits.popitem(last=False)
        else:
            self._limits.move_to_end(peer)
        return limit.allow()


class EarlyRecords:
    """Requests a prefill rank keeps word of before the engine hands them over (their machines are ``EARLY``), by
    the decode connection whose word made each record: ``refusal`` applies the caps per connection and in total."""

    def __init__(self) -> None:
        self._made_by: dict[str, bytes] = {}
        self._count: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._made_by)

    def add(self, request_id: str, identity: bytes) -> None:
        self._made_by[request_id] = identity
        self._count[identity] += 1

    def discard(self, request_id: str) -> None:
        identity = self._made_by.pop(request_id, None)
        if identity is not None:
            self._count[identity] -= 1
            if not self._count[identity]:
                del self._count[identity]

    def refusal(self, identity: bytes) -> str:
        """Why word from ``identity`` may not make another record ("" when it may)."""
        made = self._count[identity]
        if made >= MAX_EARLY_PER_PEER:
            return f"this decode connection's word of {made} requests not handed over yet is kept already"
        if len(self._made_by) >= MAX_EARLY and made >= EARLY_FLOOR:
            return f"word of {len(self._made_by)} requests not handed over yet is kept already"
        return ""
