"""``DecodeShell``: what a decode rank does, on its I/O loop, with the state machine of each request it receives
(``decode_request.DecodeRequest``).

It takes a request the engine started (``_add``: one per prefill request, and connections to the prefill ranks
it names), feeds its machine every event (its connections' state, the start's outcome, a transfer's end, a
prefill rank's ``PushResult`` or ``Problem``, an abort, the clock, the fence) and carries out the actions the
machine returns, in order (``_run``, ``decode_actions.py``): send to a prefill rank, start or re-lay out the
transfer (``Starter``), fence the transfer engine (``Mover``), give the staging room back, report the request's
one ``Completion`` (``Published``). On the clock it checks deadlines and sends the heartbeats that renew the
prefill ranks' leases of the requests it still wants.

A mixin of ``DecodeSide`` over its connections (``decode_conns.py``); all of it runs on the side's I/O loop.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Literal

from kvplane.errors import KvplaneError, TransferTimeout
from kvplane.flows.disagg.decode.decode_actions import (
    Action,
    Fence,
    GiveStaging,
    MarkStale,
    Relayout,
    Report,
    Send,
    Start,
)
from kvplane.flows.disagg.decode.decode_conns import DecodeConnections
from kvplane.flows.disagg.decode.decode_link import LinkPhase
from kvplane.flows.disagg.decode.decode_request import Phase, RankView
from kvplane.flows.disagg.decode.decode_start import Starter
from kvplane.flows.disagg.decode.records import Conn, Want
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.errors import RelayoutError
from kvplane.flows.disagg.wire.messages import MAX_HEARTBEAT_IDS, Cancel, Heartbeat, Problem, PushResult
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.results import Completion, State
from kvplane.kv.spec import KVSpec
from kvplane.metrics import recorder

logger = logging.getLogger("kvplane.disagg")


class DecodeShell(DecodeConnections):
    spec: KVSpec
    _by_remote: dict[tuple[str, str], str]
    _starter: Starter
    _next_heartbeat: float
    _next_check: float

    # -- requests -------------------------------------------------------------------------------------------
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
            conn.waiting[rid] = None
            want.conns.append(conn)
        self._connections(want)

    def _connections(self, want: Want) -> None:
        """Show the request's machine its connections as they are now."""
        views = {}
        for conn in want.conns:
            state: Literal["waiting", "ready", "failed"] = \
                "ready" if conn.ready else "failed" if conn.link.phase is LinkPhase.FAILED else "waiting"
            who = (conn.record.engine_id, conn.record.boot_id) if conn.record is not None else ("", "")
            views[conn.rank] = RankView(state, f"{conn.host}:{conn.port}", conn.link.error, *who)
        self._run(want, want.machine.connections(views))

    def _start(self, want: Want) -> None:
        for conn in want.conns:
            conn.waiting.pop(want.request_id, None)
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
            if conn.ready:
                channel.send(conn.socket, cancel, self.counters)
            else:  # sent with the next handshake with that rank that succeeds (a failed one keeps it)
                self._declines.add((conn.host, conn.port), cancel, time.monotonic(), p.remote_boot_id)

    def _on_abort(self, request_id: str) -> None:
        want = self._wants.get(request_id)
        if want is not None:
            self._run(want, want.machine.abort())

    # -- actions --------------------------------------------------------------------------------------------
    def _run(self, want: Want, actions: list[Action]) -> None:
        """Carry out what the request's machine asked for, in order."""
        for action in actions:
            if isinstance(action, Send):
                conn = want.conns[action.rank]
                if not action.ready_only or conn.ready:
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
                want.conns[action.rank].link.stale()  # its engine may have been reset: learn its descriptor again
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
            conn.waiting.pop(want.request_id, None)
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

    # -- messages -------------------------------------------------------------------------------------------
    def _on_word(self, conn: Conn, message: PushResult | Problem) -> None:
        """A ``PushResult`` or ``Problem`` about a request, to its machine: only from a rank it uses, on the
        connection to that rank."""
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

    # -- time -----------------------------------------------------------------------------------------------
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
        self._check_conns(now)
        for want in list(self._wants.values()):
            self._run(want, want.machine.tick(now))

    def _heartbeat(self) -> None:
        by_conn: dict[tuple[str, int], list[tuple[str, str]]] = {}
        for want in self._wants.values():
            for send in want.machine.heartbeat():
                conn = want.conns[send.rank]
                if conn.ready and isinstance(send.message, Heartbeat):
                    by_conn.setdefault((conn.host, conn.port), []).extend(send.message.requests)
        for key, requests in by_conn.items():
            for start in range(0, len(requests), MAX_HEARTBEAT_IDS):
                channel.send(self._conns[key].socket, Heartbeat(self.config.engine_id, self.config.rank,
                                                                requests[start : start + MAX_HEARTBEAT_IDS]),
                             self.counters)
