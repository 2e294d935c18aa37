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
and engine call to the request's machine and carries out the actions it returns (``DecodeShell._run``). This
module holds the engine-facing calls and the building of the side; its parts on the I/O loop are its mixins:
the connections to the prefill ranks and their handshakes (``decode_conns.py``), and the shell around the
requests' machines (``decode_shell.py``).

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

import logging
import time
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvplane.blocks.groups import PerGroup
from kvplane.flows.disagg.decode.declines import PendingDeclines
from kvplane.flows.disagg.decode.decode_kit import DecodeKit
from kvplane.flows.disagg.decode.decode_request import DecodeRequest, Ident
from kvplane.flows.disagg.decode.decode_shell import DecodeShell
from kvplane.flows.disagg.decode.decode_start import Starter
from kvplane.flows.disagg.decode.records import Conn, Want
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.auth import Guard, curve_keys
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.loop import IOLoop
from kvplane.flows.disagg.wire.mover import Mover
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.peers import Prober
from kvplane.flows.disagg.wire.published import Published
from kvplane.flows.disagg.wire.results import Completion
from kvplane.kv.bound import BoundKV
from kvplane.metrics.watch import watch_side

__all__ = ["DecodeSide"]
logger = logging.getLogger("kvplane.disagg")


class DecodeSide(DecodeShell):
    def __init__(self, kv: BoundKV, config: DisaggConfig) -> None:
        self.backend, self.spec, self.config = kv.backend, kv.spec, config
        self.local = LocalKV(kv, config, "decode", config.staging_bytes)
        self.counters = channel.Counters()
        self._conns: dict[tuple[str, int], Conn] = {}
        self._wants: dict[str, Want] = {}
        self._by_remote: dict[tuple[str, str], str] = {}  # (prefill engine id, its request id) -> ours
        self._out = Published()
        self._active: set[str] = set()  # the engine thread's view: started and not yet reported
        self._declines = PendingDeclines(max(config.lease_s, config.push_timeout_s))  # for ranks not ready yet
        self._next_heartbeat = 0.0
        self._next_check = 0.0
        with ExitStack() as undo:  # keys refused, a part that fails: give back what was built so far, then raise
            undo.callback(self.local.close)
            self._loop = IOLoop(f"kvplane-decode-{config.rank}", self._tick, self._publish)
            undo.callback(self._loop.context.destroy, linger=0)  # never started: close its sockets, end it
            self._guard = Guard(self._loop.context, curve_keys(config, "decode"))
            undo.callback(self._guard.stop)
            self._mover = Mover(f"kvplane-decode-{config.rank}-transfers", self.local.transport, "READ",
                                config.max_inflight, self._loop.submit, on_reset=self._on_reset)
            undo.callback(self._mover.stop)
            self._starter = Starter(DecodeKit(self.local, self.counters, self._mover, self._moved, self._loop.submit))
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
