"""``PrefillSide``: one prefill rank's end of disaggregation. It holds finished requests' blocks for decode
ranks to pull, or pushes them into blocks decode ranks registered, whole or layer by layer.

Who calls what (the engine's thread; the vLLM connector wraps these):

- ``request_finished(request_id, block_ids, num_tokens)`` once the request's KV is computed: returns the
  ``TransferParams`` a proxy forwards to decode (``.to_dict()``). The blocks are held from then on: under a
  lease that decode heartbeats renew (pull), or until they are pushed. The engine must not free them before
  ``get_finished`` reports the request.
- ``layerwise`` mode: ``start_request(request_id, block_ids, num_tokens)`` before the forward that completes
  the prompt, and ``save_layer(layer_name)`` after each attention layer has written its KV: that layer is
  written to every decode rank registered for the request while later layers compute.
- ``get_finished()`` each step: a ``Completion`` per request whose blocks kvplane released (``done``: every
  decode rank read or received them; ``failed``; ``timed_out``: the lease expired).
- ``abort(request_id)``: a request aborted mid-prefill stops pushing; it is reported once its transfers drain.

Everything else (handshakes, heartbeats, registrations, transfers) runs on this side's I/O loop thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import zmq

from kvplane.backend.base import Backend, Event
from kvplane.blocks.groups import Ids, PerGroup
from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError, ManifestMismatch
from kvplane.flows.disagg import channel
from kvplane.flows.disagg.config import DisaggConfig
from kvplane.flows.disagg.errors import DisaggConfigError
from kvplane.flows.disagg.local import LocalKV
from kvplane.flows.disagg.loop import IOLoop
from kvplane.flows.disagg.messages import (
    Cancel,
    Handshake,
    Heartbeat,
    Message,
    Problem,
    PushRegister,
    PushResult,
    ReadDone,
    Reject,
)
from kvplane.flows.disagg.outbox import Outbox
from kvplane.flows.disagg.params import TransferParams
from kvplane.flows.disagg.peers import PeerRecord, check_peer
from kvplane.flows.disagg.records import Held, Target
from kvplane.flows.disagg.results import Completion, State
from kvplane.flows.disagg.routes import layers_by_source, route_plan
from kvplane.kv.binding import LayoutChoice
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec
from kvplane.plan.planner import TransferPlan

logger = logging.getLogger("kvplane.disagg")
REMEMBERED = 10_000  # released request ids kept to answer late messages about them


class PrefillSide:
    def __init__(
        self,
        backend: Backend,
        spec: KVSpec,
        kv_caches: Mapping[str, LayerValue],
        config: DisaggConfig,
        *,
        layouts: LayoutChoice | None = None,
    ) -> None:
        if config.tp_size > 1 and not config.port:
            raise DisaggConfigError(
                f"DisaggConfig.port=0 with tp_size={config.tp_size}: decode finds prefill rank r at port + r, so a "
                f"TP prefill needs a fixed base port (e.g. port=5600: rank 0 on 5600, rank 1 on 5601)"
            )
        self.backend, self.spec, self.config = backend, spec, config
        self.local = LocalKV(backend, spec, kv_caches, config, "prefill", layouts)
        self.counters = channel.Counters()
        self._peers: dict[tuple[str, int], PeerRecord] = {}
        self._held: dict[str, Held] = {}
        self._released: OrderedDict[str, str] = OrderedDict()
        self._completions: list[Completion] = []
        self._layer_events: list[tuple[str, Event]] = []
        self._next_lease_check = 0.0
        self._loop = IOLoop(f"kvplane-prefill-{config.rank}", self._tick)
        self._socket, self.port = channel.router(self._loop.context, config.host, config.rank_port())
        self._outbox = Outbox(self.local.transport, "WRITE", config.max_inflight)
        self._loop.watch(self._socket, self._on_readable)
        self._loop.start()

    @property
    def base_port(self) -> int:
        """The instance's base port, as ``TransferParams.remote_port`` carries it (this rank's port - rank)."""
        return self.port - self.config.rank

    # -- engine-facing ------------------------------------------------------------------------------------
    def request_finished(self, request_id: str, block_ids: PerGroup, num_tokens: int) -> TransferParams:
        """Hold the request's blocks for decode and return the parameters to forward to it."""
        ids = self.local.block_ids(request_id, block_ids, num_tokens)
        self._loop.submit(lambda: self._on_finished(request_id, ids, num_tokens))
        group0 = self.spec.group(self.local.group_ids[0])
        return TransferParams(
            remote_engine_id=self.config.engine_id,
            remote_request_id=request_id,
            remote_block_ids=[ids[g].tolist() for g in self.local.group_ids],
            remote_host=self.config.host,
            remote_port=self.base_port,
            tp_size=self.config.tp_size,
            remote_block_size=group0.tokens_per_block,
            remote_num_tokens=num_tokens,
            remote_boot_id=self.local.boot_id,
            kvplane_mode=self.config.mode,
        )

    def start_request(self, request_id: str, block_ids: PerGroup, num_tokens: int) -> None:
        """Layer-wise push: the coming forward completes this request's prompt in these blocks."""
        ids = self.local.block_ids(request_id, block_ids, num_tokens)
        self._loop.submit(lambda: self._on_start(request_id, ids, num_tokens))

    def save_layer(self, layer_name: str) -> None:
        """After ``layer_name`` wrote its KV: push it to registered decode ranks once the compute reaches here."""
        self.spec.layer(layer_name)
        event = self.backend.new_event()
        event.record(self.backend.current_stream())
        self._loop.submit(lambda: self._layer_events.append((layer_name, event)))

    def abort(self, request_id: str) -> None:
        self._loop.submit(lambda: self._on_abort(request_id))

    def get_finished(self, timeout_s: float = 10.0) -> list[Completion]:
        """Requests whose blocks kvplane released since the last call (free them now)."""
        return self._loop.call(self._drain_completions, timeout_s)

    def held_requests(self, timeout_s: float = 10.0) -> int:
        """Requests whose blocks are held now (tests and stats)."""
        return self._loop.call(lambda: sum(1 for h in self._held.values() if h.known), timeout_s)

    def transfers_in_flight(self, timeout_s: float = 10.0) -> int:
        """Plans of this side queued for or moving through the transport now (tests and stats)."""
        return self._loop.call(lambda: self._outbox.moving, timeout_s)

    def close(self) -> None:
        self._loop.stop()
        self.local.close()

    def __enter__(self) -> PrefillSide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loop: engine events ------------------------------------------------------------------------------
    def _drain_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def _entry(self, request_id: str) -> Held:
        held = self._held.get(request_id)
        if held is None:
            held = self._held[request_id] = Held(request_id)
        return held

    def _on_start(self, request_id: str, ids: dict[int, Ids], num_tokens: int) -> None:
        held = self._entry(request_id)
        held.block_ids, held.num_tokens, held.known = ids, num_tokens, True
        for target in held.targets.values():
            self._build_plans(held, target)

    def _on_finished(self, request_id: str, ids: dict[int, Ids], num_tokens: int) -> None:
        held = self._entry(request_id)
        held.block_ids, held.num_tokens, held.known, held.finished = ids, num_tokens, True, True
        held.deadline = time.monotonic() + self.config.lease_s
        for target in held.targets.values():
            self._push_rest(held, target)
        self._settle(held)

    def _on_abort(self, request_id: str) -> None:
        held = self._held.get(request_id)
        if held is None or held.finished:
            return  # finished KV stays valid for decode; the lease or the readers end it
        held.aborted = True
        self._settle(held)

    def _on_layer_saved(self, layer: str) -> None:
        for held in self._held.values():
            if held.known and not held.finished and not held.aborted:
                held.saved.add(layer)
                for target in held.targets.values():
                    if layer in target.layers:
                        self._push(held, target, [layer])

    # -- loop: messages -----------------------------------------------------------------------------------
    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        for identity, message in channel.receive(sock, self.config.max_message_bytes, self.counters, routed=True):
            self._dispatch(identity, message)

    def _dispatch(self, identity: bytes, message: Message) -> None:
        if isinstance(message, Handshake):
            self._on_handshake(identity, message)
        elif isinstance(message, Heartbeat):
            now = time.monotonic()
            for rid in message.request_ids:
                held = self._held.get(rid)
                if held is not None and held.finished:
                    held.deadline = now + self.config.lease_s
                elif held is None and rid in self._released:
                    self._reply(identity, Problem(rid, self.config.rank, self._released[rid]))
        elif isinstance(message, ReadDone):
            self._on_read_done(identity, message)
        elif isinstance(message, PushRegister):
            self._on_register(identity, message)
        elif isinstance(message, Cancel):
            self._on_cancel(message)
        else:
            self.counters.rejected += 1
            logger.warning("prefill rank %d: %s is not a message a prefill rank takes; dropped",
                           self.config.rank, type(message).__name__)

    def _on_handshake(self, identity: bytes, hello: Handshake) -> None:
        try:
            record = check_peer(self.local, hello, expect_role="decode", identity=identity)
        except ManifestMismatch as e:
            self._reply(identity, Reject(e.field, repr(e.local), repr(e.remote), str(e)))
            return
        except KvplaneError as e:  # a manifest that does not decode, a transport that cannot reach it
            self._reply(identity, Reject("handshake", "", "", str(e)))
            return
        key = (hello.engine_id, hello.rank)
        old = self._peers.get(key)
        if old is not None and old.boot_id != record.boot_id:
            self._forget_peer(old, f"decode {hello.engine_id} rank {hello.rank} restarted")
        self._peers[key] = record
        self._reply(identity, self.local.handshake())

    def _on_read_done(self, identity: bytes, done: ReadDone) -> None:
        held = self._held.get(done.request_id)
        if held is None:
            if done.request_id in self._released:
                return
            # vLLM gives the proxy kv_transfer_params a step before its worker calls request_finished here, so a
            # fast decode may be done reading first: keep its word until the request comes (or a lease passes)
            held = self._entry(done.request_id)
            held.deadline = time.monotonic() + self.config.lease_s
        if done.expect_boot != self.local.boot_id:
            self._reply(identity, Problem(done.request_id, self.config.rank, "stale: this prefill rank restarted"))
            return
        held.reader_tp = done.tp_size
        held.readers[(done.engine_id, done.rank)] = done.ok
        self._settle(held)

    def _on_register(self, identity: bytes, reg: PushRegister) -> None:
        rid = reg.request_id
        peer = self._peers.get((reg.engine_id, reg.rank))
        problem = ""
        if reg.expect_boot != self.local.boot_id:
            problem = "stale: this prefill rank restarted; handshake again"
        elif peer is None or peer.identity != identity:
            problem = "handshake before registering a push"
        elif rid in self._released and rid not in self._held:
            problem = f"request is no longer held ({self._released[rid]})"
        if problem:
            self._reply(identity, Problem(rid, self.config.rank, problem))
            return
        assert peer is not None
        held = self._entry(rid)
        if not held.known:
            held.deadline = time.monotonic() + self.config.push_timeout_s  # waiting for the request itself
        held.target_tp = reg.tp_size
        layers = layers_by_source(peer.manifest, self.config.tp_size, rid).get(self.config.rank, [])
        target = Target(peer, reg, layers)
        previous = held.targets.get((reg.engine_id, reg.rank))
        if previous is not None and previous.inflight:
            target.error = "registered twice while the first push was in flight"
        held.targets[(reg.engine_id, reg.rank)] = target
        if held.finished:
            self._push_rest(held, target)
        elif held.block_ids is not None:
            self._build_plans(held, target)
            self._push(held, target, [x for x in target.layers if x in held.saved])
        self._settle(held)

    def _on_cancel(self, cancel: Cancel) -> None:
        held = self._held.get(cancel.request_id)
        target = held.targets.get((cancel.engine_id, cancel.rank)) if held is not None else None
        if held is None or target is None:
            return
        target.cancelled = True
        target.error = target.error or "cancelled by the decode rank"
        self._settle(held)

    # -- loop: pushing ------------------------------------------------------------------------------------
    def _source_ids(self, held: Held, target: Target) -> dict[int, Ids] | None:
        """The request's block ids when a push to ``target`` can be planned (it expects no more tokens than
        this prefill computed), else None."""
        if target.error or held.block_ids is None:
            return None
        if target.register.num_tokens > held.num_tokens:
            target.error = (f"decode expects {target.register.num_tokens} tokens, this prefill computed "
                            f"{held.num_tokens}; both must count the same prompt")
            return None
        return held.block_ids

    def _route(self, src_ids: dict[int, Ids], target: Target, layers: list[str], offset: int) -> TransferPlan:
        reg = target.register
        dst_ids = {int(g): np.asarray(v, dtype=np.int64) for g, v in reg.block_ids.items()}
        staging = (reg.staging_addr + offset, reg.staging_bytes - offset) if reg.staging_addr else None
        return route_plan(self.local.manifest, target.peer.manifest, src_ids, dst_ids, reg.num_tokens, layers,
                          staging)

    def _build_plans(self, held: Held, target: Target) -> None:
        """Per-layer WRITE plans for one decode rank, each sent as its layer is saved; staged layers land at
        consecutive staging offsets, in layer order, where the decode rank re-lays them out."""
        src_ids = self._source_ids(held, target) if target.plans is None else None
        if src_ids is None:
            return
        plans: dict[str, CopyPlan] = {}
        offset = 0
        try:
            for layer in target.layers:
                tp = self._route(src_ids, target, [layer], offset)
                offset += tp.staging_bytes
                plans[layer] = tp.plan
        except KvplaneError as e:
            target.error = f"cannot plan the push: {e}"
            return
        target.plans = plans

    def _push_rest(self, held: Held, target: Target) -> None:
        """The request is finished: write every layer not yet sent. When none was (a whole-request push) and
        nothing is staged, one plan over all layers is built in one planner call instead of one per layer."""
        if not target.sent and target.plans is None and not target.register.staging_addr:
            src_ids = self._source_ids(held, target)
            if src_ids is None or target.cancelled or held.aborted:
                return
            try:
                plan = self._route(src_ids, target, target.layers, 0).plan
            except KvplaneError as e:
                target.error = f"cannot plan the push: {e}"
                return
            self._send(held, target, target.layers, plan)
            return
        self._build_plans(held, target)
        self._push(held, target, target.layers)

    def _push(self, held: Held, target: Target, layers: list[str]) -> None:
        if target.plans is None or target.error or target.cancelled or held.aborted:
            return
        todo = [x for x in layers if x not in target.sent]
        if todo:
            plans = [target.plans[x] for x in todo]
            self._send(held, target, todo, CopyPlan.concat(plans) if len(plans) > 1 else plans[0])

    def _send(self, held: Held, target: Target, layers: list[str], plan: CopyPlan) -> None:
        target.sent.update(layers)
        target.inflight += 1

        def landed(error: KvplaneError | None) -> None:
            target.inflight -= 1
            if error is not None and not target.error:
                target.error = f"WRITE failed: {error}"
            self._settle(held)

        self._outbox.put(target.peer.handle, plan.coalesced(), landed)

    # -- loop: completion ---------------------------------------------------------------------------------
    def _settle(self, held: Held) -> None:
        """Report finished pushes, and release the request once nothing more can happen to its blocks."""
        for target in held.targets.values():
            if target.reported or target.inflight:
                continue
            complete = held.finished and set(target.layers) <= target.sent
            if target.error or held.aborted or complete or not target.layers:
                reason = target.error or ("aborted on the prefill instance" if held.aborted else "")
                ok = not reason and (complete or not target.layers)
                self._reply(target.peer.identity, PushResult(held.request_id, self.config.rank, ok, reason))
                target.reported = True
        if not held.known:
            return
        inflight = any(t.inflight for t in held.targets.values())
        if inflight:
            return
        if held.aborted:
            self._release(held, "failed", "aborted before its prefill finished")
            return
        if not held.finished:
            return
        if held.reader_tp and len(held.readers) >= held.reader_tp:
            failed = [k for k, ok in held.readers.items() if not ok]
            if failed:
                self._release(held, "failed", f"decode rank(s) {failed} reported the read failed")
            else:
                self._release(held, "done")
        elif held.target_tp and len(held.targets) >= held.target_tp and all(t.reported for t in held.targets.values()):
            errors = [t.error for t in held.targets.values() if t.error]
            self._release(held, "failed" if errors else "done", "; ".join(errors))

    def _release(self, held: Held, state: State, reason: str = "") -> None:
        del self._held[held.request_id]
        self._released[held.request_id] = f"{state}{': ' + reason if reason else ''}"
        while len(self._released) > REMEMBERED:
            self._released.popitem(last=False)
        if state != "done":
            logger.warning("prefill rank %d: request %s %s%s", self.config.rank, held.request_id, state,
                           f" ({reason})" if reason else "")
        self._completions.append(Completion(held.request_id, state, reason=reason))

    def _forget_peer(self, peer: PeerRecord, why: str) -> None:
        for held in list(self._held.values()):
            for target in held.targets.values():
                if target.peer is peer and not target.reported:
                    target.error = target.error or why
            self._settle(held)

    def _reply(self, identity: bytes, message: Message) -> None:
        channel.send(self._socket, message, self.counters, identity)

    # -- loop: time ---------------------------------------------------------------------------------------
    def _tick(self) -> float:
        while self._layer_events and self._layer_events[0][1].query():
            layer, _ = self._layer_events.pop(0)
            self._on_layer_saved(layer)
        self._outbox.pump()
        now = time.monotonic()
        if now >= self._next_lease_check:
            self._next_lease_check = now + min(0.05, self.config.lease_s / 10)
            for held in list(self._held.values()):
                if held.deadline < now and not any(t.inflight for t in held.targets.values()):
                    self._expire(held)
        return 0.0005 if (self._outbox.busy or self._layer_events) else 0.05

    def _expire(self, held: Held) -> None:
        if not held.known:  # a registration whose request never came here: nothing of the engine's is held
            del self._held[held.request_id]
            for target in held.targets.values():
                if not target.reported:
                    self._reply(target.peer.identity, PushResult(held.request_id, self.config.rank, False,
                                                                 "the prefill instance never saw this request"))
            return
        for target in held.targets.values():
            if not target.reported:
                target.error = target.error or "lease expired before the push completed"
                self._reply(target.peer.identity, PushResult(held.request_id, self.config.rank, False, target.error))
                target.reported = True
        self._release(held, "timed_out", f"lease of {self.config.lease_s} s expired without the decode finishing")

