"""What a side's I/O loop hands the engine thread: completions and counts, through thread-safe structures.

The engine thread never waits on the loop: ``get_finished`` takes what the loop published, so nothing the loop
does (a handshake, a long transfer) delays it, and a completion once published is handed out exactly once
whatever the caller does. The loop ``add``s completions as requests end and ``publish``es after each pass,
counts first, so a caller that sees a completion also sees the counts of the same moment.
"""

from __future__ import annotations

from collections import deque

from kvplane.flows.disagg.wire.results import Completion


class Published:
    def __init__(self) -> None:
        self._staged: list[Completion] = []  # loop thread only
        self._ready: deque[Completion] = deque()  # append on the loop, popleft on the engine thread
        self.in_flight = 0  # plans queued or moving, as of the last publish
        self.draining = 0  # decode: requests with a verdict waiting for the fence (the loop sets it)
        self.registered: set[str] = set()  # prefill: requests a push registration reached (loop adds/discards)

    def add(self, completion: Completion) -> None:
        self._staged.append(completion)

    def publish(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self._ready.extend(self._staged)
        self._staged.clear()

    def drain(self) -> list[Completion]:
        out: list[Completion] = []
        while True:
            try:
                out.append(self._ready.popleft())
            except IndexError:
                return out
