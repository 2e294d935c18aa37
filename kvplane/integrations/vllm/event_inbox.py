"""``EventInbox``: the scheduler half's end of kvplane's KV events: an event is published once every worker
reported it.

A block is loadable from a tier only when every TP rank holds its part, and each rank reports its own copy of
the event; vLLM's executor concatenates them (``KVConnectorKVEvents.add_events``) and says how many workers it
waits for (``KVConnectorOutput.expected_finished_count``, 0 where one worker reports alone). Ranks store in
lockstep, but a store-tier put may complete a step later on one rank: copies are counted across steps, and an
event is ready once it was seen from every worker. Both tables are bounded: the oldest partial counts and
ready events go first, counted in ``dropped`` and logged once. No I/O, no clock: vLLM's scheduler thread calls
``add`` from ``update_connector_output`` and ``take`` from ``take_events``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

logger = logging.getLogger("kvplane.vllm")
INBOX_LIMIT = 10_000


class EventInbox:
    def __init__(self, limit: int = INBOX_LIMIT) -> None:
        self.limit, self.dropped = limit, 0
        self._seen: dict[Any, int] = {}  # event -> copies seen so far (insertion order: oldest first)
        self._ready: deque[Any] = deque()

    def add(self, events: list[Any], workers: int) -> None:
        need = max(1, workers)
        for event in events:
            n = self._seen.pop(event, 0) + 1
            if n >= need:
                self._ready.append(event)
            else:
                self._seen[event] = n
        over = max(0, len(self._seen) - self.limit) + max(0, len(self._ready) - self.limit)
        for _ in range(max(0, len(self._seen) - self.limit)):
            del self._seen[next(iter(self._seen))]
        for _ in range(max(0, len(self._ready) - self.limit)):
            self._ready.popleft()
        if over:
            if not self.dropped:
                logger.warning("kvplane: more than %d KV events wait for every worker or for vLLM to take them; "
                               "dropping the oldest from now on", self.limit)
            self.dropped += over

    def take(self) -> list[Any]:
        out = list(self._ready)
        self._ready.clear()
        return out

    def pending(self) -> int:
        """Events seen from some workers and not yet from all (the tests check it)."""
        return len(self._seen)
