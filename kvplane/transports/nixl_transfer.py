"""One plan in flight through NIXL: a state machine over its chunks, advanced by ``poll``.

``NixlTransport.submit`` creates it, handing it what it needs (the agent, the lock that guards it, the memory
type, the config, and the plan mapped onto the peer's prepared descriptor lists where it maps), and posts the
first chunk. A mapped chunk is one ``make_prepped_xfer`` on index arrays; otherwise its descriptor lists are
built for it (``get_xfer_descs`` + ``initialize_xfer``). Each ``poll`` checks the request in flight (``check_xfer_state``),
releases it when it ends, posts the next chunk, and resubmits a failed one after back-off. Refusals that no
retry can fix (an address NIXL finds in no registration, a peer that disconnected) fail at once.

A request still in flight at the deadline is not released: UCX keeps what it queued (over TCP, a link that
comes back resumes it), and releasing the handle does not stop it. The transfer fails unsettled (``settled``
is False) and keeps its handle until the transport resets the agent (``abandon``), the fence that ends it.

NIXL's handles free themselves when collected, on whatever thread that happens. So every handle and prepared
list a transfer holds is let go under the agent lock: when it ends, when it is cancelled, or (unsettled, and
then kept by the transport) when the agent is reset.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvplane.errors import TransferFailed, TransferTimeout
from kvplane.transports.batching import Deadline, backoff_s, descriptor_table
from kvplane.transports.chunked import ChunkedTransfer, Job

if TYPE_CHECKING:
    from threading import RLock

    from kvplane.transports.base import TransportConfig
    from kvplane.transports.nixl_prep import Prepared, PrepStats

POLL_INTERVAL_S = 0.0002  # wait() sleeps this long between polls; NIXL's progress thread moves the data
PERMANENT = ("nixlNotFoundError", "nixlInvalidParamError", "nixlRemoteDisconnectError")


class NixlTransfer(ChunkedTransfer):
    engine = "NIXL"

    def __init__(
        self,
        agent: Any,
        lock: RLock,
        memory: tuple[str, int],
        config: TransportConfig,
        job: Job,
        prepared: Prepared | None = None,
        stats: PrepStats | None = None,
    ) -> None:
        super().__init__(config, job)
        self._agent, self._lock = agent, lock
        self._prepared = prepared  # None: descriptor lists built per chunk
        self._stats = stats  # where the time making requests is added up
        self._mem_type, self._dev_id = memory
        self._attempt = 0  # failed attempts of the chunk in flight
        self._retry_at = 0.0
        self._handle: Any = None
        self._done = False
        # _unsettled: failed while NIXL still had a request in flight

    @property
    def finished(self) -> bool:
        return self._done or self._error is not None

    @property
    def settled(self) -> bool:
        return not self._unsettled

    # -- caller side --------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._chunks:
            if self._notify is not None:  # nothing to move: the notification alone
                try:
                    self._agent.send_notif(self._peer, self._notify)
                except Exception as e:
                    self._error = TransferFailed(f"NIXL notify to {self._peer}: {type(e).__name__}: {e}")
                    return
            self._done = True
            return
        self._step()

    def poll(self) -> bool:
        self._advance()
        return self._done

    def wait(self, timeout_s: float | None = None) -> None:
        limit = self._limit_s(timeout_s)
        until = Deadline(time.monotonic() + limit)
        while True:
            moved = self._advance()
            if self._done:
                return
            if until.expired():
                self.cancel()
                raise self._timed_out(limit)
            if not moved:
                time.sleep(POLL_INTERVAL_S)

    def _advance(self) -> bool:
        """One step under the agent lock; raises the transfer's error. True when a chunk ended or started."""
        moved = False
        if self._error is None and not self._done:
            with self._lock:
                moved = self._step()
        if self._error is not None:
            raise self._error
        return moved

    def cancel(self) -> None:
        """Give up on the transfer. A request still in flight stays with NIXL (releasing its handle does not
        stop UCX), so the transfer ends unsettled until the transport resets the agent."""
        with self._lock:
            if not self._done and self._error is None:
                self._unsettled = self._handle is not None
                self._error = TransferTimeout(self._where("was abandoned (timed out or the transport closed)"))
            if not self._unsettled:  # freed here, under the lock, not by whichever thread collects the transfer
                self._prepared = None

    def abandon(self) -> None:
        """The transport drops the agent (reset or close): the request in flight dies with it. The transfer lets
        go of the agent, so nothing keeps it alive."""
        self._handle, self._unsettled, self._agent, self._prepared = None, False, None, None
        if not self._done and self._error is None:
            self._error = TransferFailed(self._where("ended: the NIXL agent was reset"))

    # -- state machine ------------------------------------------------------------------------------------
    def _step(self) -> bool:
        """Check the request in flight; when it ended, release it and post the next chunk (at most one).

        NIXL may finish a request inside ``transfer`` (same-host UCX copies in the calling thread), so posting
        one chunk per step keeps ``submit`` and ``poll`` to one engine call's worth of work.
        """
        agent = self._agent
        moved, posted = False, False
        while self._error is None and not self._done:
            if self._handle is None:
                if posted or time.monotonic() < self._retry_at:
                    break
                state, posted = self._post(agent), True
            else:
                try:
                    state = str(agent.check_xfer_state(self._handle))
                except Exception as e:
                    state = self._refused(e)
            if state == "PROC":
                if self._deadline.expired():  # kept, not released: only a reset of the agent ends it
                    self._unsettled = True
                    self._error = TransferTimeout(self._where("did not finish before the deadline"))
                break
            moved = True
            self._release()
            if state == "DONE":
                self._index += 1
                self._attempt = 0
                self._done = self._index == len(self._chunks)
            else:
                self._failed(f"the engine reported {state}")
        if self.finished:
            self._prepared = None  # lets go of the prepared lists (a finer grid may have replaced them)
        return moved or posted

    def _post(self, agent: Any) -> str:
        start, stop = self._chunks[self._index]
        last = self._index == len(self._chunks) - 1
        notify = self._notify if last and self._notify is not None else b""
        mem, dev = self._mem_type, self._dev_id
        length = self._length[start:stop]
        try:
            began = time.perf_counter()
            if self._prepared is not None:
                lidx, ridx = self._prepared.chunk(start, stop)
                lists = self._prepared.lists
                self._handle = agent.make_prepped_xfer(self._op, lists.local, lidx, lists.remote, ridx, notify)
            else:
                local = agent.get_xfer_descs(descriptor_table(self._local[start:stop], length, dev), mem)
                remote = agent.get_xfer_descs(descriptor_table(self._remote[start:stop], length, dev), mem)
                self._handle = agent.initialize_xfer(self._op, local, remote, self._peer, notify)
            if self._stats is not None:
                self._stats.made(self._prepared is not None, time.perf_counter() - began)
            return str(agent.transfer(self._handle))
        except Exception as e:
            return self._refused(e)

    def _refused(self, e: Exception) -> str:
        """Turn an exception from NIXL into a state: permanent ones fail the transfer at once."""
        kind = type(e).__name__
        if kind in PERMANENT:
            self._release()
            why = "the peer disconnected" if "Disconnect" in kind else "an address lies outside registered memory"
            self._error = TransferFailed(self._where(f"refused by NIXL ({kind}: {e}); {why}"))
        return f"ERR ({kind}: {e})"

    def _failed(self, reason: str) -> None:
        if self._error is not None:
            return
        retries = self._config.retries
        if self._attempt >= retries:
            self._error = TransferFailed(self._where(f"failed {retries + 1} times (last: {reason})"))
            return
        self._retry_at = time.monotonic() + min(backoff_s(self._config, self._attempt),
                                                self._deadline.remaining())
        self._attempt += 1
        if self._deadline.expired():
            self._error = TransferTimeout(self._where(f"deadline passed while retrying ({reason})"))

    def _release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # a request NIXL could not abort: its handle is freed with the agent
                pass
