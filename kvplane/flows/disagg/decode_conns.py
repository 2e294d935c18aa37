"""``DecodeConnections``: a decode rank's connections to the prefill ranks, and what comes in on them.

One DEALER socket per prefill rank's address, opened by the first request that names it (``_conn``), and kept
for later requests. On it this rank handshakes: its manifest and transport descriptor under a new number
(``_hello``; an answer to an earlier number is dropped), the answer checked (``peers.check_hello``), the prefill's
transport probed, then the connection is ready. It handshakes again on the same socket after a transport was
reset, or when a request names another lifetime of the rank (``_rehandshake``), and defers that while this
rank's engine is not running again yet. A handshake that fails or times out is shown to the requests waiting
on it; it is tried again on the next request that names the rank, or after a backoff while a decline waits for
it (declines for a rank not ready are kept, and sent once its handshake succeeds: ``declines.py``).

Messages on a connection are dispatched here: handshake answers are taken here, a request's ``PushResult`` or
``Problem`` goes to the request's shell (``_on_word``), and a request waiting on a connection is shown it as
it changes (``_connections``): both are ``DecodeShell``'s (``decode_shell.py``). A mixin of ``DecodeSide``; all
of it runs on the side's I/O loop thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from functools import partial

import msgspec
import zmq

from kvplane.errors import KvplaneError
from kvplane.flows.disagg import channel
from kvplane.flows.disagg.declines import PendingDeclines
from kvplane.flows.disagg.errors import DisaggError
from kvplane.flows.disagg.messages import Handshake, Message, Problem, PushResult, Reject
from kvplane.flows.disagg.peers import Prober, check_hello, record
from kvplane.flows.disagg.records import Conn, Want
from kvplane.flows.disagg.side import SideLifecycle

logger = logging.getLogger("kvplane.disagg")
RETRY_FIRST_S = 0.5  # a failed handshake with a rank that declines wait for is tried again after this, doubling
RETRY_MAX_S = 30.0


class DecodeConnections(SideLifecycle):
    _conns: dict[tuple[str, int], Conn]
    _wants: dict[str, Want]
    _declines: PendingDeclines
    _attempts: itertools.count[int]
    _failures: dict[tuple[str, int], int]
    _prober: Prober

    # -- the shell's (decode_shell.py) ----------------------------------------------------------------------
    def _connections(self, want: Want) -> None:
        """Show the request's machine its connections as they are now."""
        raise NotImplementedError

    def _on_word(self, conn: Conn, message: PushResult | Problem) -> None:
        """A prefill rank's word about one request, come on ``conn``."""
        raise NotImplementedError

    # -- connections ----------------------------------------------------------------------------------------
    def _conn(self, host: str, port: int, rank: int, boot_id: str) -> Conn:
        """The connection to one prefill rank; a new handshake when there is none, it failed, or the rank's
        lifetime differs from the one a request names (it restarted)."""
        conn = self._conns.get((host, port))
        other_lifetime = conn is not None and conn.state == "ready" and boot_id and conn.record is not None \
            and conn.record.boot_id != boot_id
        # again on the same socket: the prefill takes a second connection under our name only once the first is
        # gone (a close races the new handshake), and replacing our record fails our requests in flight there
        if conn is not None and conn.state == "ready" and \
                (conn.stale or conn.generation != self.local.transport.generation or other_lifetime):
            self._rehandshake(conn)
        if conn is None or conn.state == "failed":
            # a failed handshake (one that timed out while the prefill stalled, say) is tried again on the same
            # socket: the prefill knows this rank by the ZMQ connection it handshook on, and a second connection
            # under this rank's name is refused while the first lives or its handshake is still being checked
            sock = conn.socket if conn is not None else \
                channel.dealer(self._loop.context, host, port, self.config.max_message_bytes, self._guard.client,
                               self.config.peer_timeout_s)
            conn = Conn(host, port, rank, sock, time.monotonic())
            self._conns[(host, port)] = conn
            self._loop.watch(sock, partial(self._on_readable, conn))  # replaces the failed record's handler
            self._hello(conn)
        return conn

    def _hello(self, conn: Conn) -> None:
        """Send this rank's handshake on ``conn`` under a new number; an answer to an earlier one is dropped."""
        hello = self.local.handshake()  # made again (and the engine started again) after a reset
        conn.deferred = self.local.generation != self.local.transport.generation
        if conn.deferred:  # the engine is down since a reset: _check_conns sends it once it runs (the old
            return  # descriptor names an engine that is gone, so the prefill would refuse it)
        conn.generation = self.local.generation
        conn.attempt, conn.answered = next(self._attempts), False
        channel.send(conn.socket, msgspec.structs.replace(hello, attempt=conn.attempt), self.counters)

    def _rehandshake(self, conn: Conn) -> None:
        """A transport was reset since this connection handshook, or a request names another lifetime of the
        prefill rank: handshake again on the same socket, so the prefill rank loads this rank's new descriptor and
        this rank its (either may have changed)."""
        conn.stale, conn.state, conn.started = False, "handshaking", time.monotonic()
        conn.deferred = self.local.generation != self.local.transport.generation
        if conn.deferred:  # this rank's engine is not running again yet: _check_conns sends it then
            return
        logger.warning("decode rank %d: handshaking again with prefill rank %d at %s:%d (a transport was reset, or "
                       "a request names another lifetime of it)",
                       self.config.rank, conn.rank, conn.host, conn.port)
        self._hello(conn)

    def _on_reset(self, why: str) -> None:
        for conn in self._conns.values():
            if conn.state == "ready":
                conn.stale = True

    # -- messages -------------------------------------------------------------------------------------------
    def _on_readable(self, conn: Conn, sock: zmq.Socket[bytes]) -> None:
        self._receive(sock, False, lambda _, __, message: self._dispatch(conn, message))

    def _dispatch(self, conn: Conn, message: Message) -> None:
        if isinstance(message, Handshake | Reject) and (message.attempt != conn.attempt or conn.answered):
            logger.info("decode rank %d: prefill rank at %s:%d answered handshake %d (%s) after handshake %d was "
                        "sent; dropped", self.config.rank, conn.host, conn.port, message.attempt,
                        type(message).__name__, conn.attempt)
        elif isinstance(message, Handshake | Reject) and conn.state == "handshaking" and \
                conn.generation != self.local.transport.generation:
            # it answers a handshake that named this rank's engine before a reset (sent before it, or a retry
            # sent meanwhile): whatever the verdict, it is about a descriptor that is gone; ask again with the new
            conn.answered = True
            self._rehandshake(conn)
        elif isinstance(message, Handshake):
            self._on_handshake(conn, message)
        elif isinstance(message, Reject):
            conn.answered = True
            if conn.state in ("handshaking", "probing"):
                self._conn_failed(conn, f"the prefill rank rejected the handshake: {message.reason}")
        elif isinstance(message, PushResult | Problem):
            self._on_word(conn, message)
        else:
            self.counters.rejected += 1
            logger.warning("decode rank %d: %s is not a message a decode rank takes; dropped", self.config.rank,
                           type(message).__name__)

    def _on_handshake(self, conn: Conn, hello: Handshake) -> None:
        """The answer to ``conn``'s latest handshake: also when that one timed out (the prefill stalled), since
        the prefill took it, and declines may wait for the rank."""
        if conn.state not in ("handshaking", "failed"):
            return
        conn.answered, conn.started = True, time.monotonic()
        try:
            manifest, info = check_hello(self.local, hello, expect_role="prefill")
            if hello.rank != conn.rank:
                raise DisaggError(f"{conn.host}:{conn.port} answered as rank {hello.rank}, expected rank {conn.rank}")
        except KvplaneError as e:
            self._conn_failed(conn, str(e))
            return

        def connected(handle: str, error: str) -> None:
            if conn.state != "probing":
                return
            if error:
                self._conn_failed(conn, f"its transport does not answer: {error}")
                return
            conn.record, conn.state, conn.retry_at = record(hello, manifest, info, handle), "ready", float("inf")
            self._failures.pop((conn.host, conn.port), None)
            self._conn_ready(conn)

        conn.state = "probing"
        if not self._prober.connect(info, connected):
            self._conn_failed(conn, "too many transports being connected at once")

    def _conn_ready(self, conn: Conn) -> None:
        boot = conn.record.boot_id if conn.record is not None else ""
        for cancel in self._declines.take((conn.host, conn.port), time.monotonic(), boot):
            channel.send(conn.socket, cancel, self.counters)
        for rid in list(conn.waiting):
            want = self._wants.get(rid)
            if want is not None:
                self._connections(want)

    def _conn_failed(self, conn: Conn, reason: str) -> None:
        conn.state, conn.error, conn.deferred = "failed", reason, False  # its declines wait for the next one
        failures = self._failures[(conn.host, conn.port)] = self._failures.get((conn.host, conn.port), 0) + 1
        conn.retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(failures - 1, 16))
        logger.warning("decode rank %d: prefill rank at %s:%d: %s", self.config.rank, conn.host, conn.port, reason)
        for rid in list(conn.waiting):
            want = self._wants.get(rid)
            if want is not None:
                self._connections(want)
        conn.waiting.clear()

    # -- time -----------------------------------------------------------------------------------------------
    def _check_conns(self, now: float) -> None:
        """Deferred handshakes whose engine runs again, handshakes past their timeout, and failed connections
        a decline waits for whose backoff ended."""
        for conn in list(self._conns.values()):
            if conn.deferred and conn.state == "handshaking":
                self.local.handshake()  # made again once the engine runs
                if self.local.generation == self.local.transport.generation:
                    conn.deferred = False
                    self._rehandshake(conn)
            if conn.state in ("handshaking", "probing") and now - conn.started > self.config.handshake_timeout_s:
                self._conn_failed(conn, "this rank's transfer engine did not start again after a reset within "
                                        f"handshake_timeout_s={self.config.handshake_timeout_s}" if conn.deferred
                                  else f"no answer to the handshake within {self.config.handshake_timeout_s} s; "
                                       f"is the prefill instance running and reachable?")
        for where in self._declines.waiting(now):  # tell ranks a request was given up as soon as they answer
            failed = self._conns.get(where)
            if failed is not None and failed.state == "failed" and now >= failed.retry_at:
                failed.retry_at = float("inf")
                self._conn(failed.host, failed.port, failed.rank, "")
