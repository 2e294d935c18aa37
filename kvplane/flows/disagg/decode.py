"""``DecodeSide``: one decode rank's end of disaggregation. It pulls a finished request's KV from the prefill
ranks that hold it, or registers its blocks for them to push into, and says when the KV is ready.

Who calls what (the engine's thread; the vLLM connector wraps these):

- ``start_pull(request_id, params, block_ids)``: ``params`` are what the prefill instance returned for the
  request (``TransferParams`` or its dict, as a proxy forwards it); ``block_ids`` are this rank's blocks for it.
- ``register_push(request_id, params, block_ids, num_tokens)``: the same blocks, offered to the prefill ranks
  to write into, before or after the prefill finishes (whichever comes first).
- ``get_finished()`` each step: one ``Completion`` per request: ``done`` (every byte landed and was re-laid
  out where needed: the blocks may be read), ``failed`` or ``timed_out`` (``failed_block_ids`` lists the
  blocks to recompute or give up on). Until then kvplane may still write the blocks: do not free them.
- ``abort(request_id)``: stop; the request is reported once no transfer can write its blocks any more.
- ``decline(params)``: the engine will never receive a request it did not start (its client went away first):
  the prefill ranks named in ``params`` are told, so they free its blocks now rather than at their lease's end.
- ``pending_requests()``, ``draining_requests()``: requests not yet reported, and those of them that have a
  verdict but wait for the fence.

Each request is a pure state machine (``decode_request.DecodeRequest``): this class routes every message, timer
and engine call to the request's machine and carries out the actions it returns (``_run``).

The fence: a request is reported only once no transfer of the engine's can write its blocks.
A READ that timed out while the engine still has it queued (a link that is down) makes the transfer thread
reset the engine first (``Mover``); a push whose prefill did not answer within ``drain_timeout_s`` of the
verdict is fenced the same way. After a reset, prefill ranks handshake again before their next request, so
they load this rank's new transport descriptor.

Handshakes (manifest and compatibility check, transport descriptors), heartbeats that renew the prefill's
lease, and a push's re-layout run on this side's I/O loop thread; transfers on its transfer thread
(``mover.py``), a staged pull's chunks on the transfer thread and its re-layouts on their own thread
(``staged_pull.py``), and ``get_finished`` never waits for either. Messages about a request carry its token. Every wait is bounded by
``DisaggConfig``; a prefill rank that vanishes ends its requests ``failed`` or ``timed_out``, never a hang.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from contextlib import ExitStack
from functools import partial
from typing import Any, Literal

import msgspec
import numpy as np
import zmq

from kvplane.backend.base import Backend
from kvplane.blocks.groups import PerGroup
from kvplane.errors import KvplaneError, TransferTimeout
from kvplane.flows.disagg import channel
from kvplane.flows.disagg.auth import Guard, curve_keys
from kvplane.flows.disagg.config import DisaggConfig
from kvplane.flows.disagg.declines import PendingDeclines
from kvplane.flows.disagg.decode_actions import (
    Action,
    Fence,
    GiveStaging,
    MarkStale,
    Relayout,
    Report,
    Send,
    Start,
)
from kvplane.flows.disagg.decode_request import DecodeRequest, Ident, Phase, RankView
from kvplane.flows.disagg.decode_start import Starter
from kvplane.flows.disagg.errors import DisaggError, RelayoutError
from kvplane.flows.disagg.local import LocalKV
from kvplane.flows.disagg.loop import IOLoop
from kvplane.flows.disagg.messages import (
    MAX_HEARTBEAT_IDS,
    Cancel,
    Handshake,
    Heartbeat,
    Message,
    Problem,
    PushResult,
    Reject,
)
from kvplane.flows.disagg.mover import Mover
from kvplane.flows.disagg.params import TransferParams
from kvplane.flows.disagg.peers import Prober, check_hello, record
from kvplane.flows.disagg.published import Published
from kvplane.flows.disagg.records import Conn, Want
from kvplane.flows.disagg.results import Completion, State
from kvplane.flows.disagg.side import SideLifecycle
from kvplane.kv.binding import LayoutChoice
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec
from kvplane.metrics import recorder
from kvplane.metrics.watch import watch_side

logger = logging.getLogger("kvplane.disagg")
RETRY_FIRST_S = 0.5  # a failed handshake with a rank that declines wait for is tried again after this, doubling
RETRY_MAX_S = 30.0


class DecodeSide(SideLifecycle):
    def __init__(
        self,
        backend: Backend,
        spec: KVSpec,
        kv_caches: Mapping[str, LayerValue],
        config: DisaggConfig,
        *,
        layouts: LayoutChoice | None = None,
    ) -> None:
        self.backend, self.spec, self.config = backend, spec, config
        self.kv_caches = kv_caches
        self.local = LocalKV(backend, spec, kv_caches, config, "decode", layouts, config.staging_bytes)
        self.counters = channel.Counters()
        self._conns: dict[tuple[str, int], Conn] = {}
        self._wants: dict[str, Want] = {}
        self._by_remote: dict[tuple[str, str], str] = {}  # (prefill engine id, its request id) -> ours
        self._out = Published()
        self._active: set[str] = set()  # the engine thread's view: started and not yet reported
        self._declines = PendingDeclines(max(config.lease_s, config.push_timeout_s))  # for ranks not ready yet
        self._next_heartbeat = 0.0
        self._next_check = 0.0
        self._attempts = itertools.count(1)  # handshake numbers: an answer is taken only for the latest one sent
        self._failures: dict[tuple[str, int], int] = {}  # handshakes failed in a row, per prefill address
        with ExitStack() as undo:  # keys refused, a part that fails: give back what was built so far, then raise
            undo.callback(self.local.close)
            self._loop = IOLoop(f"kvplane-decode-{config.rank}", self._tick, self._publish)
            undo.callback(self._loop.context.destroy, linger=0)  # never started: close its sockets, end it
            self._guard = Guard(self._loop.context, curve_keys(config, "decode"))
            undo.callback(self._guard.stop)
            self._mover = Mover(f"kvplane-decode-{config.rank}-transfers", self.local.transport, "READ",
                                config.max_inflight, self._loop.submit, on_reset=self._on_reset)
            undo.callback(self._mover.stop)
            self._starter = Starter(self)
            undo.callback(self._starter.close)
            self._prober = Prober(self.local.transport, self._loop.submit, config.probe_timeout_s)
            self._loop.start()  # last: nothing after it can fail, so a started loop is never undone
            undo.pop_all()
        watch_side(self, "decode")

    def close(self) -> None:
        """The re-layout executor first, while the loop runs: a running re-layout ends (and its chunk's end is
        reported) before the loop stops and the local KV closes, so none writes after that; then the rest."""
        self._starter.close()
        super().close()

    # -- engine-facing ------------------------------------------------------------------------------------
    def start_pull(
        self, request_id: str, params: TransferParams | Mapping[str, Any], block_ids: PerGroup,
        num_tokens: int | None = None, local_tokens: Mapping[int, int] | None = None,
    ) -> None:
        """Read the request's KV from the prefill ranks named in ``params`` into ``block_ids``; ``local_tokens``:
        the first tokens of each KV-cache group this rank holds already, which are not read (``routes.py``)."""
        p = params if isinstance(params, TransferParams) else TransferParams.from_dict(params)
        if not p.remote_block_ids or not p.remote_boot_id or not p.kvplane_token:
            raise DisaggError(
                f"request {request_id!r}: kv_transfer_params carry no remote_block_ids/remote_boot_id/"
                f"kvplane_token, so there is nothing to pull; forward what the prefill's request_finished returned"
            )
        want = self._want(request_id, p, block_ids, p.remote_num_tokens if num_tokens is None else num_tokens,
                          "pull", self.config.handshake_timeout_s + self.config.transfer_timeout_s, local_tokens)
        if want.num_tokens > p.remote_num_tokens:
            raise DisaggError(
                f"request {request_id!r}: num_tokens={want.num_tokens} but the prefill holds "
                f"{p.remote_num_tokens}; pull at most what it computed"
            )
        self._submit(want)

    def register_push(
        self, request_id: str, params: TransferParams | Mapping[str, Any], block_ids: PerGroup, num_tokens: int,
        local_tokens: Mapping[int, int] | None = None,
    ) -> None:
        """Offer ``block_ids`` to the prefill ranks named in ``params`` to write the request's KV into, but for
        the first ``local_tokens`` of each KV-cache group, which this rank holds already."""
        p = params if isinstance(params, TransferParams) else TransferParams.from_dict(params)
        if not p.kvplane_token:
            raise DisaggError(
                f"request {request_id!r}: kv_transfer_params.kvplane_token is empty; a push needs the token the "
                f"proxy gives both instances (build the params with TransferParams.for_push)"
            )
        want = self._want(request_id, p, block_ids, num_tokens, "push", self.config.push_timeout_s, local_tokens)
        self._submit(want)

    def abort(self, request_id: str) -> None:
        self._loop.submit(lambda: self._on_abort(request_id))

    def decline(self, params: TransferParams | Mapping[str, Any]) -> None:
        """Tell the prefill ranks named in ``params`` that this rank will never receive the request (it was not
        started here: ``abort`` ends one that was), so they free its blocks now. Nothing is reported for it. A
        prefill rank takes a decline only over a connection that handshook: one this rank has no connection to
        costs a handshake (kept for later requests), and where that fails the decline waits for the next handshake
        with the rank that succeeds (``declines.py``); a rank never reached frees at its lease's or push timeout's
        end."""
        p = params if isinstance(params, TransferParams) else TransferParams.from_dict(params)
        if not p.kvplane_token:
            raise DisaggError(
                f"prefill request {p.remote_request_id!r}: kv_transfer_params.kvplane_token is empty, so no prefill "
                f"rank would take the decline; forward what the prefill (or proxy) returned"
            )
        self._loop.submit(lambda: self._decline(p))

    def get_finished(self, timeout_s: float = 10.0) -> list[Completion]:
        """Requests that ended since the last call: ``done`` ones may be read, the rest recomputed or failed.
        Never waits on the I/O loop; ``timeout_s`` is accepted for older callers and unused."""
        done = self._out.drain()
        self._active.difference_update(c.request_id for c in done)
        return done

    def pending_requests(self, timeout_s: float = 10.0) -> int:
        """Requests started and not yet reported by ``get_finished`` (draining ones included)."""
        return len(self._active)

    def draining_requests(self) -> int:
        """Requests with a verdict (failed, timed out, aborted) that are not reported yet because a transfer
        may still write their blocks; each ends within the bound docs/disagg.md gives."""
        return self._out.draining

    def _want(self, request_id: str, p: TransferParams, block_ids: PerGroup, num_tokens: int, mode: str,
              budget_s: float, local_tokens: Mapping[int, int] | None) -> Want:
        if request_id in self._active:
            raise DisaggError(
                f"request {request_id!r} is already receiving KV; wait for its Completion from get_finished() "
                f"before starting it again"
            )
        ids = self.local.block_ids(request_id, block_ids, num_tokens, distinct=True)
        held = self.local.held_tokens(request_id, local_tokens or {}, num_tokens)
        remote = {g: np.asarray(v, dtype=np.int64) for g, v in p.block_ids(self.local.group_ids).items()} \
            if p.remote_block_ids else {}
        c = self.config
        ident = Ident(request_id, "pull" if mode == "pull" else "push", p.remote_request_id, p.remote_engine_id,
                      p.remote_boot_id, p.kvplane_token, p.tp_size, c.engine_id, c.rank, c.tp_size,
                      c.drain_timeout_s)
        return Want(request_id, p, ids, remote, num_tokens, mode, DecodeRequest(ident, time.monotonic() + budget_s),
                    local_tokens=held, first=held)

    def _submit(self, want: Want) -> None:
        self._active.add(want.request_id)
        self._loop.submit(lambda: self._add(want))

    # -- loop: requests -----------------------------------------------------------------------------------
    def _publish(self) -> None:
        self._out.draining = sum(1 for w in self._wants.values() if w.machine.phase is Phase.DRAINING)
        self._out.publish(self._mover.moving)

    def _add(self, want: Want) -> None:
        rid, key = want.request_id, (want.params.remote_engine_id, want.params.remote_request_id)
        other = self._by_remote.get(key)
        if other is not None:  # the prefill's replies name only its request id: two receivers could not tell theirs
            self._report(want, "failed", f"prefill request {key[1]!r} of {key[0]!r} is already being received by "
                                         f"request {other!r} on this rank; forward its kv_transfer_params once")
            return
        self._wants[rid] = want
        self._by_remote[(want.params.remote_engine_id, want.params.remote_request_id)] = rid
        p = want.params
        for rank in range(p.tp_size):
            self._declines.discard((p.remote_host, p.remote_port + rank), p.remote_request_id)
            conn = self._conn(p.remote_host, p.remote_port + rank, rank, p.remote_boot_id if want.mode == "pull" else "")
            conn.waiting.add(rid)
            want.conns.append(conn)
        self._connections(want)

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
        if conn.deferred:  # the engine is down since a reset: _check_deadlines sends it once it runs (the old
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
        if conn.deferred:  # this rank's engine is not running again yet: _check_deadlines sends it then
            return
        logger.warning("decode rank %d: handshaking again with prefill rank %d at %s:%d (a transport was reset, or "
                       "a request names another lifetime of it)",
                       self.config.rank, conn.rank, conn.host, conn.port)
        self._hello(conn)

    def _on_reset(self, why: str) -> None:
        for conn in self._conns.values():
            if conn.state == "ready":
                conn.stale = True

    def _connections(self, want: Want) -> None:
        """Show the request's machine its connections as they are now."""
        views = {}
        for conn in want.conns:
            state: Literal["waiting", "ready", "failed"] = \
                "ready" if conn.state == "ready" else "failed" if conn.state == "failed" else "waiting"
            who = (conn.record.engine_id, conn.record.boot_id) if conn.record is not None else ("", "")
            views[conn.rank] = RankView(state, f"{conn.host}:{conn.port}", conn.error, *who)
        self._run(want, want.machine.connections(views))

    def _start(self, want: Want) -> None:
        for conn in want.conns:
            conn.waiting.discard(want.request_id)
        try:
            ranks = self._starter.start(want)
        except KvplaneError as e:  # nothing was submitted: the prefill ranks are told, so they free it now
            self._run(want, want.machine.cannot_plan(str(e)))
            return
        machine = want.machine
        if machine.phase is Phase.CONNECT and machine.verdict is None:
            self._run(want, machine.no_room() if ranks is None else machine.started(sorted(ranks)))

    def _moved(self, want: Want, rank: int, error: KvplaneError | None) -> None:
        """A READ's callback from the transfer thread, on the loop."""
        self._run(want, want.machine.transfer_ended(rank, "" if error is None else str(error),
                                                    isinstance(error, TransferTimeout),
                                                    local=isinstance(error, RelayoutError)))

    def _decline(self, p: TransferParams) -> None:
        cancel = Cancel(p.remote_request_id, self.config.engine_id, self.config.rank, p.kvplane_token)
        for rank in range(p.tp_size):
            conn = self._conn(p.remote_host, p.remote_port + rank, rank, p.remote_boot_id)
            if conn.state == "ready":
                channel.send(conn.socket, cancel, self.counters)
            else:  # sent with the next handshake with that rank that succeeds (a failed one keeps it)
                self._declines.add((conn.host, conn.port), cancel, time.monotonic(), p.remote_boot_id)

    def _on_abort(self, request_id: str) -> None:
        want = self._wants.get(request_id)
        if want is not None:
            self._run(want, want.machine.abort())

    # -- loop: actions ------------------------------------------------------------------------------------
    def _run(self, want: Want, actions: list[Action]) -> None:
        """Carry out what the request's machine asked for, in order."""
        for action in actions:
            if isinstance(action, Send):
                conn = want.conns[action.rank]
                if not action.ready_only or (conn.state == "ready" and conn.record is not None):
                    channel.send(conn.socket, action.message, self.counters)
                elif action.later and isinstance(action.message, Cancel):  # with the rank's next good handshake
                    boot = want.params.remote_boot_id if want.mode == "pull" else ""  # a pull's: that lifetime's
                    self._declines.add((conn.host, conn.port), action.message, time.monotonic(), boot)
            elif isinstance(action, Start):
                self._start(want)
            elif isinstance(action, Relayout):
                try:
                    self._starter.relayout(want)
                    error = ""
                except Exception as e:  # a re-layout that fails leaves the blocks untrustworthy
                    error = repr(e)
                self._run(want, want.machine.relaid_out(error))
            elif isinstance(action, Fence):
                self._mover.fence(partial(self._fenced, want), action.reason)
            elif isinstance(action, MarkStale):
                conn = want.conns[action.rank]
                if conn.state == "ready":
                    conn.stale = True  # the prefill's engine may have been reset: learn its descriptor again
            elif isinstance(action, GiveStaging):
                for offset, _, _ in want.staged:
                    self.local.arena.give(offset)
                want.staged.clear()
            elif isinstance(action, Report):
                self._report(want, action.state, action.reason)
            else:
                logger.log(action.level, "decode rank %d: %s", self.config.rank, action.text)

    def _fenced(self, want: Want) -> None:
        self._run(want, want.machine.fenced())

    def _report(self, want: Want, state: State, reason: str) -> None:
        for conn in want.conns:
            conn.waiting.discard(want.request_id)
        if self._wants.get(want.request_id) is want:
            del self._wants[want.request_id]
            key = (want.params.remote_engine_id, want.params.remote_request_id)
            if self._by_remote.get(key) == want.request_id:
                del self._by_remote[key]
        failed, skipped = want.split(self.spec)
        if state != "done":
            logger.warning("decode rank %d: request %s %s (%s)", self.config.rank, want.request_id, state, reason)
        recorder().request_ended(self.config.mode if want.mode == "push" else want.mode, state)  # push/layerwise
        self._out.add(Completion(want.request_id, state, {} if state == "done" else failed, reason, skipped))

    # -- loop: messages -----------------------------------------------------------------------------------
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
            engine = conn.record.engine_id if conn.record is not None else ""
            rid = self._by_remote.get((engine, message.request_id))
            want = self._wants.get(rid) if rid is not None else None
            if want is None:  # a late word for a request already reported
                if message.request_id:  # not a connection check
                    logger.info("decode rank %d: %s for request %s of %s came after the request was reported; "
                                "dropped", self.config.rank, type(message).__name__, message.request_id, engine)
                return
            if message.rank != conn.rank or all(c.socket is not conn.socket for c in want.conns):
                self.counters.rejected += 1
                logger.warning("decode rank %d: %s for request %s names prefill rank %d but came on the connection to "
                               "rank %d at %s:%d, which the request does not use for it; dropped", self.config.rank,
                               type(message).__name__, message.request_id, message.rank, conn.rank, conn.host,
                               conn.port)
                return
            self._run(want, want.machine.problem(conn.rank, message.reason) if isinstance(message, Problem)
                      else want.machine.push_result(conn.rank, message.ok, message.reason))
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

    # -- loop: time ---------------------------------------------------------------------------------------
    def _tick(self) -> float:
        now = time.monotonic()
        self._prober.expire(now)
        if now >= self._next_check:
            self._next_check = now + 0.02
            self._check_deadlines(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_s
            self._heartbeat()
        return 0.02

    def _check_deadlines(self, now: float) -> None:
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
        for want in list(self._wants.values()):
            self._run(want, want.machine.tick(now))

    def _heartbeat(self) -> None:
        by_conn: dict[tuple[str, int], list[tuple[str, str]]] = {}
        for want in self._wants.values():
            for send in want.machine.heartbeat():
                conn = want.conns[send.rank]
                if conn.state == "ready" and isinstance(send.message, Heartbeat):
                    by_conn.setdefault((conn.host, conn.port), []).extend(send.message.requests)
        for key, requests in by_conn.items():
            for start in range(0, len(requests), MAX_HEARTBEAT_IDS):
                channel.send(self._conns[key].socket, Heartbeat(self.config.engine_id, self.config.rank,
                                                                requests[start : start + MAX_HEARTBEAT_IDS]),
                             self.counters)
