"""``DecodeConnections``: a decode rank's connections to the prefill ranks, and what comes in on them.

One DEALER socket per prefill rank's address, opened by the first request that names it (``_conn``), and kept
for the side's life with its ``Link`` (``decode_link.py``), the machine that decides when to handshake, which
answer counts and when the connection is ready, failed or stale. This mixin runs the link's actions: it sends
this rank's manifest and transport descriptor under the link's number, checks the answer
(``peers.check_hello``), probes the prefill's transport, and shows the requests waiting on the connection
how it went. Declines for a rank not ready are kept, and sent once its handshake succeeds (``declines.py``).

Messages on a connection are dispatched here: handshake answers are taken here, a request's ``PushResult`` or
``Problem`` goes to the request's shell (``_on_word``), and a request waiting on a connection is shown it as
it changes (``_connections``): both are ``DecodeShell``'s (``decode_shell.py``). A mixin of ``DecodeSide``; all
of it runs on the side's I/O loop thread.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import msgspec
import zmq

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.decode.declines import PendingDeclines
from kvplane.flows.disagg.decode.decode_link import (
    Check,
    EngineView,
    Failed,
    Link,
    LinkAction,
    LinkPhase,
    Note,
    Probe,
    Ready,
    SendHello,
)
from kvplane.flows.disagg.decode.records import Conn, Want
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.messages import Handshake, Message, Problem, PushResult, Reject
from kvplane.flows.disagg.wire.peers import PeerRecord, Prober, check_hello, record
from kvplane.flows.disagg.wire.side import SideLifecycle
from kvplane.kv.manifest import Manifest
from kvplane.transports.base import PeerInfo

logger = logging.getLogger("kvplane.disagg")


class DecodeConnections(SideLifecycle):
    _conns: dict[tuple[str, int], Conn]
    _wants: dict[str, Want]
    _declines: PendingDeclines
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
        """The connection to one prefill rank, opened on first use; its link handshakes when there was none, it
        failed or went stale, or the rank's lifetime differs from the one a request names (it restarted). Always
        on the same socket: the prefill knows this rank by the ZMQ connection it handshook on, and refuses a
        second one under this rank's name while the first lives."""
        conn = self._conns.get((host, port))
        if conn is None:
            sock = channel.dealer(self._loop.context, host, port, self.config.max_message_bytes, self._guard.client,
                                  self.config.peer_timeout_s)
            conn = self._conns[(host, port)] = Conn(host, port, rank, sock, Link(self.config.handshake_timeout_s))
            self._loop.watch(sock, partial(self._on_readable, conn))
        self._renew(conn)
        self._link(conn, conn.link.need(time.monotonic(), self._engine(), boot_id))
        return conn

    @staticmethod
    def _renew(conn: Conn) -> None:
        """A failed link is about to handshake again: nothing its last peer said is kept (who it was, which
        layers it made this rank stage), as on a connection never used."""
        if conn.link.phase is LinkPhase.FAILED:
            conn.record, conn.checked, conn.stages = None, None, {}

    def _engine(self, refresh: bool = True) -> EngineView:
        if refresh:
            self.local.handshake()  # made again (and the engine started again) after a reset
        return EngineView(self.local.transport.generation, self.local.generation == self.local.transport.generation)

    def _on_reset(self, why: str) -> None:
        for conn in self._conns.values():
            conn.link.stale()

    def _link(self, conn: Conn, actions: list[LinkAction], hello: Handshake | None = None) -> None:
        """Carry out what ``conn``'s link asked for, in order (``hello``: the answer being checked)."""
        for action in actions:
            if isinstance(action, SendHello):
                message = msgspec.structs.replace(self.local.handshake(), attempt=action.attempt)
                if action.attempt > 1:
                    logger.warning("decode rank %d: handshaking again with prefill rank %d at %s:%d (a transport was "
                                   "reset, it failed, or a request names another lifetime of it)",
                                   self.config.rank, conn.rank, conn.host, conn.port)
                channel.send(conn.socket, message, self.counters)
            elif isinstance(action, Check) and hello is not None:
                self._check(conn, hello)
            elif isinstance(action, Probe) and conn.checked is not None:
                self._probe(conn, conn.checked)
            elif isinstance(action, Ready):
                self._conn_ready(conn)
            elif isinstance(action, Failed):
                self._conn_failed(conn, action.reason)
            elif isinstance(action, Note):
                logger.info("decode rank %d: prefill rank at %s:%d %s", self.config.rank, conn.host, conn.port,
                            action.text)

    # -- messages -------------------------------------------------------------------------------------------
    def _on_readable(self, conn: Conn, sock: zmq.Socket[bytes]) -> None:
        self._receive(sock, False, lambda _, __, message: self._dispatch(conn, message))

    def _dispatch(self, conn: Conn, message: Message) -> None:
        if isinstance(message, Handshake):
            self._link(conn, conn.link.answer(time.monotonic(), message.attempt, None, self._engine()), message)
        elif isinstance(message, Reject):
            self._link(conn, conn.link.answer(time.monotonic(), message.attempt, message.reason, self._engine()))
        elif isinstance(message, PushResult | Problem):
            self._on_word(conn, message)
        else:
            self.counters.rejected += 1
            logger.warning("decode rank %d: %s is not a message a decode rank takes; dropped", self.config.rank,
                           type(message).__name__)

    def _check(self, conn: Conn, hello: Handshake) -> None:
        """Check the answer to the link's latest handshake; what it says is kept until the probe ends."""
        try:
            manifest, info = check_hello(self.local, hello, expect_role="prefill")
            if hello.rank != conn.rank:
                raise DisaggError(f"{conn.host}:{conn.port} answered as rank {hello.rank}, expected rank {conn.rank}")
        except KvplaneError as e:
            self._link(conn, conn.link.checked(time.monotonic(), str(e)))
            return
        conn.checked = (hello, manifest, info)
        self._link(conn, conn.link.checked(time.monotonic()))

    def _probe(self, conn: Conn, checked: tuple[Handshake, Manifest, PeerInfo]) -> None:
        hello, manifest, info = checked

        def connected(handle: str, error: str) -> None:
            if conn.checked is not checked:  # a later answer replaced it
                return
            found: PeerRecord | None = None if error else record(hello, manifest, info, handle)
            if found is not None:
                conn.record = found
            self._link(conn, conn.link.probed(time.monotonic(), f"its transport does not answer: {error}" if error
                                              else "", found.boot_id if found is not None else ""))

        if not self._prober.connect(info, connected):
            self._link(conn, conn.link.probed(time.monotonic(), "too many transports being connected at once"))

    def _conn_ready(self, conn: Conn) -> None:
        boot = conn.record.boot_id if conn.record is not None else ""
        for cancel in self._declines.take((conn.host, conn.port), time.monotonic(), boot):
            channel.send(conn.socket, cancel, self.counters)
        for rid in list(conn.waiting):
            want = self._wants.get(rid)
            if want is not None:
                self._connections(want)

    def _conn_failed(self, conn: Conn, reason: str) -> None:
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
        links = list(self._conns.values())
        engine = self._engine(refresh=any(conn.link.phase is LinkPhase.DEFERRED for conn in links))
        for conn in links:
            self._link(conn, conn.link.tick(now, engine))
        for where in self._declines.waiting(now):  # tell ranks a request was given up as soon as they answer
            failed = self._conns.get(where)
            if failed is not None and failed.link.phase is LinkPhase.FAILED and now >= failed.link.retry_at:
                self._renew(failed)
                self._link(failed, failed.link.retry(now, self._engine()))
