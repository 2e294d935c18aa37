"""Bounds on what a peer's messages can make a side do: replies and log lines per second, records kept for
requests the engine has not handed over yet.

A flood of messages that each deserve an answer (a heartbeat naming 4096 finished requests, thousands of
``ReadDone`` for a previous boot) costs at most ``RateLimit``'s budget in replies and warnings; what is dropped
is counted, and the count is logged once the budget refills.
"""

from __future__ import annotations

import logging
import time

MAX_EARLY = 4096  # requests a prefill rank keeps word of before the engine hands them over (all peers)
REPLIES_PER_S = 200.0  # problem replies and warnings per second per side (burst: as many)


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
