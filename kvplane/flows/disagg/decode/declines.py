"""Declines a decode rank could not send yet: ``Cancel``s for prefill ranks without a ready connection.

A prefill rank takes a ``Cancel`` only from a connection that handshook (``admission.Admission.sender``), so
``DecodeSide.decline`` sends at once over a ready connection and otherwise starts a handshake (or waits for the
one under way) and leaves the Cancel here, per prefill address. ``take`` hands an address's Cancels over once a
handshake with it succeeds: the one the decline started, or any later one (a request's or another decline's).
A handshake that fails keeps them for the next. Bounded: ``MAX_DECLINES`` per address (the oldest goes first),
``MAX_DECLINE_PEERS`` addresses (the least recently declined to goes first), and a Cancel older than
``horizon_s`` is dropped when taken: by then the prefill freed the request at its lease's or push timeout's end.
While Cancels wait for an address (``waiting``), ``DecodeSide`` handshakes again with it with back-off, so they go
as soon as the rank can be reached, without waiting for a later request to it. A pull that failed before it asked
anything (its handshake timed out or was refused) leaves its Cancel here too, and a pull of the same request
started again takes it back (``discard``). A pull's decline names the prefill lifetime that holds the request (``remote_boot_id``): it is dropped when the
rank that answers is another lifetime (it restarted, and the request is gone with the old process).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvplane.flows.disagg.wire.limits import MAX_DECLINE_PEERS, MAX_DECLINES
from kvplane.flows.disagg.wire.messages import Cancel

Where = tuple[str, int]  # a prefill rank's side-channel host and port


class PendingDeclines:
    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._by_peer: OrderedDict[Where, deque[tuple[float, str, Cancel]]] = OrderedDict()

    def add(self, where: Where, cancel: Cancel, now: float, boot_id: str = "") -> None:
        """Keep ``cancel`` for the rank at ``where``; ``boot_id``: the lifetime of it that holds the request
        ("" when not known yet: a push)."""
        queue = self._by_peer.get(where)
        if queue is None:
            queue = self._by_peer[where] = deque(maxlen=MAX_DECLINES)
            while len(self._by_peer) > MAX_DECLINE_PEERS:
                self._by_peer.popitem(last=False)
        self._by_peer.move_to_end(where)
        queue.append((now, boot_id, cancel))

    def take(self, where: Where, now: float, boot_id: str) -> list[Cancel]:
        """The Cancels for ``where``, now answering as lifetime ``boot_id``, still worth sending; none are kept
        for it after."""
        queue = self._by_peer.pop(where, None)
        if queue is None:
            return []
        return [c for at, boot, c in queue if now - at <= self.horizon_s and boot in ("", boot_id)]

    def discard(self, where: Where, request_id: str) -> None:
        """Forget the Cancels for ``request_id`` kept for ``where``: this rank receives the request again (a proxy
        retry after a pull that failed), and a late Cancel would free its blocks under the new READ."""
        queue = self._by_peer.get(where)
        if queue is not None:
            queue_items = [item for item in queue if item[2].request_id != request_id]
            queue.clear()
            queue.extend(queue_items)

    def waiting(self, now: float) -> list[Where]:
        """The addresses that still have a Cancel worth sending (the shell handshakes again with those); the
        ones left with none are forgotten."""
        for where in list(self._by_peer):
            queue = self._by_peer[where]
            while queue and now - queue[0][0] > self.horizon_s:
                queue.popleft()
            if not queue:
                del self._by_peer[where]
        return list(self._by_peer)

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_peer.values())
