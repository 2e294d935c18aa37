"""When a transport tries again to start an engine that did not come back after a reset (a device still down).

``MooncakeTransport`` and ``NixlTransport`` keep one ``RestartBackoff`` each: a start is tried at most once per
back-off, which doubles from 0.2 s up to ``RESTART_BACKOFF_MAX_S``; a successful start, or a new reset, clears it.
What a start does (re-registering memory, loading peers again) stays with each transport.
"""

from __future__ import annotations

import time

from kvplane.errors import TransportError

RESTART_BACKOFF_MAX_S = 1.0


class RestartBackoff:
    def __init__(self) -> None:
        self.retry_at = 0.0  # time.monotonic() before which no start is tried
        self.failures = 0  # failed starts in a row

    def check_due(self, down: str) -> None:
        """Raise ``TransportError`` (``down``: why no engine runs) while the back-off runs."""
        now = time.monotonic()
        if now < self.retry_at:
            raise TransportError(f"{down}; it is started again in {self.retry_at - now:.1f} s")

    def failed(self) -> None:
        self.failures += 1
        self.retry_at = time.monotonic() + min(RESTART_BACKOFF_MAX_S, 0.1 * 2 ** self.failures)

    def clear(self) -> None:
        self.retry_at, self.failures = 0.0, 0
