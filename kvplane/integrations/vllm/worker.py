"""The worker-side half of the connector: runs each step's work on this rank's KV caches.

Called by vLLM's model runner, in this order: ``register_kv_caches`` once; per step ``start_load_kv`` (with the
step's ``KVPlaneMetadata``), ``wait_for_layer_load`` / ``save_kv_layer`` in every attention layer,
``wait_for_save`` after the forward, ``get_finished`` and ``get_block_ids_with_load_errors``; ``shutdown``.
It drives up to three kvplane flows over the same caches: the ``OffloadEngine`` (host tier, serving the
scheduler's lookups from rank 0), a ``PrefillSide`` and a ``DecodeSide``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvplane.backend.base import Backend
from kvplane.errors import KvplaneError, LayoutError
from kvplane.flows.disagg import Completion, DecodeSide, PrefillSide
from kvplane.flows.offload import OffloadEngine
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.device import select_backend
from kvplane.integrations.vllm.holds import LookupHolds
from kvplane.integrations.vllm.layouts import backend_name, cross_layer_logical, layout_for_backend
from kvplane.integrations.vllm.lookup import LookupServer, lookup_address
from kvplane.integrations.vllm.metadata import KVPlaneMetadata, Send
from kvplane.integrations.vllm.receives import decline, finished_receives, skipping_groups, start_receives
from kvplane.integrations.vllm.spec import layouts_for, spec_from_vllm
from kvplane.integrations.vllm.tier_events import TierEvents
from kvplane.integrations.vllm.worker_book import WorkerBook
from kvplane.kv.binding import LayoutChoice, check_whole_allocations, matching_layouts
from kvplane.kv.bound import bind
from kvplane.kv.layouts import LayerValue, Layout
from kvplane.kv.spec import KVSpec

logger = logging.getLogger("kvplane.vllm")
EVENTS = ("loads", "stores", "receives", "sends", "failed_receives", "load_error_blocks", "receive_skipped_blocks")


class WorkerSide:
    tier_events: TierEvents | None = None  # with vLLM's KV events on: what the offload tiers did, as events
    def __init__(
        self, config: ConnectorConfig, kv_cache_config: Any, backend: Backend | None = None, *, tp_rank: int = 0,
        dp_rank: int = 0, kv_lora_rank: int | None = None,
    ) -> None:
        self.config, self.kv_cache_config, self.backend = config, kv_cache_config, backend
        self.tp_rank, self.dp_rank, self.kv_lora_rank = tp_rank, dp_rank, kv_lora_rank
        self.spec: KVSpec | None = None
        self.layouts: LayoutChoice | None = None  # chosen per family at registration (the startup line)
        self.offload: OffloadEngine | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.lookup_server: LookupServer | None = None
        self.holds: LookupHolds | None = None  # rank 0: host blocks promised by lookups
        self._lock = threading.Lock()  # the offload engine is single-threaded; the lookup server shares it
        self._load_errors: set[int] = set()  # block ids to report to vLLM
        self._book = WorkerBook()  # one record per request whose KV moves
        self._failed_requests: set[str] = set()  # failed receives to report by request id (several KV-cache groups)
        # vLLM maps failed block ids back to requests only when there is one KV-cache group
        self.failures_by_request = len(getattr(kv_cache_config, "kv_cache_groups", ())) > 1
        self._failed_receives: list[Completion] = []  # receives that failed to start, reported with the next ones
        self._pushing_layers = False  # this step's forward completes a layer-wise request's prompt
        self._step: KVPlaneMetadata | None = None  # bound for the step now running
        self._saves_started = False
        self._skipping = skipping_groups(kv_cache_config)  # groups whose prefix-cache hits a receive leaves out
        self.counters = dict.fromkeys(EVENTS, 0)
        self.kv_events = False  # vLLM publishes KV events: the offload tiers report to ``tier_events``

    # -- setup --------------------------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: Mapping[str, LayerValue], attn_backends: Mapping[str, Any] | None = None,
        cache_dtype: str = "auto", *, whole: bool = True,
    ) -> None:
        """Bind the flows to vLLM's tensors: one tensor per layer (CUDA) or a tuple (Ascend's k/v, nope/rope).

        ``attn_backends`` (layer name -> vLLM attention backend class) decide each family's layout from the
        backend's own shape function; without them the device backend's default layouts apply. Every check
        (layouts, shapes, strides, whole allocations) runs before any memory is registered with an engine.
        """
        self.spec = spec_from_vllm(self.kv_cache_config, list(kv_caches), kv_lora_rank=self.kv_lora_rank)
        backend = self.backend = self.backend or select_backend(self.config.device, kv_caches)
        read = self._read_layouts(kv_caches, attn_backends or {}, cache_dtype, backend.layouts)
        layouts = self.layouts = layouts_for({**backend.layouts, **read}, self.config.layouts)
        if whole:
            check_whole_allocations(kv_caches, slack=backend.registration_alignment)
        kv = bind(backend, self.spec, kv_caches, layouts)  # every LayoutError before any flow registers memory
        if self.config.offload is not None:
            self.offload = OffloadEngine(kv, self.config.offload, tp_rank=self.tp_rank, tp_size=self.config.tp_size)
            if self.kv_events:  # after sleep mode, the queue vLLM has not taken yet goes on
                self.tier_events = TierEvents.over(self.offload.index.pools, self.tier_events)
                self.offload.listen(self.tier_events)
            if self.tp_rank == 0:
                self.holds = LookupHolds(self.offload)
                self.lookup_server = LookupServer(
                    lookup_address(self.config.engine_id, self.dp_rank), self.holds.hold, self._lock,
                    self.offload.store_presence,
                )
        if self.config.is_prefill:
            self.prefill = PrefillSide(kv, self.config.disagg_for(self.tp_rank))
        if self.config.is_decode:
            self.decode = DecodeSide(kv, self.config.disagg_for(self.tp_rank))

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any, cache_dtype: str = "auto") -> None:
        """vLLM's one tensor for every layer (``prefer_cross_layer_blocks``): per-layer views of it, registered
        like per-layer tensors. Block ``i`` of every layer is one contiguous range, so plans move one
        descriptor per block for all layers wherever the other side is cross-layer too."""
        logical = cross_layer_logical(kv_cache, attn_backend)
        names = [name for tensor in self.kv_cache_config.kv_cache_tensors for name in tensor.shared_by]
        if logical.shape[0] != len(self.kv_cache_config.kv_cache_tensors):
            raise LayoutError(
                f"cross-layer KV cache of logical shape {tuple(logical.shape)} has {logical.shape[0]} layers, the "
                f"KV cache config has {len(self.kv_cache_config.kv_cache_tensors)} tensors; register the tensor "
                f"vLLM allocated for this config"
            )
        views = {name: logical[i] for i, tensor in enumerate(self.kv_cache_config.kv_cache_tensors)
                 for name in tensor.shared_by}
        check_whole_allocations({"<cross-layer>": kv_cache})
        self.register_kv_caches({name: views[name] for name in names}, {name: attn_backend for name in names},
                                cache_dtype, whole=False)

    def _read_layouts(
        self, kv_caches: Mapping[str, LayerValue], attn_backends: Mapping[str, Any], cache_dtype: str,
        defaults: Mapping[str, str],
    ) -> dict[str, str]:
        """Each family's layout, read from the attention backend's shape function where it has one, else from the
        first layer's tensor (vLLM 0.33 describes one cache layout for all layers instead); one per family. The
        config's ``layouts`` still override what is read here."""
        spec = self.spec
        if spec is None:
            return {}
        found: dict[str, tuple[str, str]] = {}
        for layer in spec.layers:
            backend_cls = attn_backends.get(layer.name)
            if layer.family in (self.config.layouts or {}) or (backend_cls is None and layer.family in found):
                continue  # the config names this family's layout, or one layer's tensor already told
            if backend_cls is not None and hasattr(backend_cls, "get_kv_cache_shape"):
                head_size = (sum(s.head_dim for s in layer.slots) if layer.family == "mla"
                             else layer.slots[0].head_dim)
                block_size = spec.group(layer.group_id).tokens_per_block
                layout = layout_for_backend(backend_cls, layer.family, head_size, block_size, layer.slots[0].dtype,
                                            cache_dtype)
            else:  # no shape function (vLLM 0.33, vllm-ascend, no model loaded): the tensor decides
                layout = self._layout_of_tensor(spec, layer.name, kv_caches[layer.name], backend_cls,
                                                defaults.get(layer.family))
            who = backend_name(backend_cls) if backend_cls is not None else "its tensor"
            seen = found.setdefault(layer.family, (layout.name, who))
            if seen[0] != layout.name:
                raise LayoutError(
                    f"layers of family {layer.family!r} use two KV layouts: {seen[0]} ({seen[1]}) and {layout.name} "
                    f"({who}, layer {layer.name!r}); kvplane takes one layout per family"
                )
        return {family: name for family, (name, _) in found.items()}

    @staticmethod
    def _layout_of_tensor(
        spec: KVSpec, layer_name: str, value: LayerValue, backend_cls: Any, default: str | None = None
    ) -> Layout:
        candidates = matching_layouts(spec, layer_name, value)
        preferred = [c for c in candidates if c.name == default]
        if preferred or len(candidates) == 1:
            return (preferred or candidates)[0]
        shapes = [tuple(t.shape) for t in ((value,) if hasattr(value, "shape") else value)]
        layer = spec.layer(layer_name)
        raise LayoutError(
            f"layer {layer_name!r} ({backend_name(backend_cls) if backend_cls is not None else 'no backend'}): "
            f"tensor(s) of shape {shapes} match {[c.name for c in candidates] or 'no'} kvplane layout of family "
            f"{layer.family!r} for the KV spec (slots {[(s.name, s.heads, s.head_dim, s.dtype) for s in layer.slots]}); "
            f"name the layout in kv_connector_extra_config.layouts"
        )

    # -- per step -----------------------------------------------------------------------------------------
    def begin_step(self, meta: KVPlaneMetadata) -> None:
        """vLLM bound this step's metadata (before the forward, in every vLLM): nothing started yet."""
        self._step, self._saves_started = meta, False
        self._pushing_layers = False

    def end_step(self) -> None:
        self._step = None

    def _start_saves(self, meta: KVPlaneMetadata) -> None:
        """Open this step's stores and layer-wise pushes, once: from ``start_load_kv`` where vLLM calls it before
        the forward, else from the first ``save_kv_layer`` (vLLM 0.33 calls ``start_load_kv`` after the forward
        unless the step loads synchronously), so that every layer's copy starts as soon as the layer is done."""
        if self._saves_started:
            return
        self._saves_started = True
        if self.offload is not None and meta.stores:
            with self._lock:
                self._store(self.offload, meta)
        self._pushing_layers = bool(meta.layerwise)
        if self.prefill is not None:
            for send in meta.layerwise:
                self._hand_over(send, finished=False)

    def start_load_kv(self, meta: KVPlaneMetadata) -> None:
        for rid in meta.aborts:
            self._abort(rid)
        if self.offload is not None and (meta.loads or meta.released):
            # the store is asked outside the lock, and only for loads whose lookup's answer was not kept
            in_store = self.offload.loads_presence([(j.request_id, j.hashes) for j in meta.loads])
            with self._lock:
                self._load(self.offload, meta, in_store)
        self._start_saves(meta)  # after the loads: a store must not take host blocks a load of this step reads
        started, failed = start_receives(self.decode, meta.receives, self._skipping)
        self._failed_receives += failed  # reported with the next completions, by vLLM's policy
        for rid in started:
            self._book.receiving(rid)
        self.counters["receives"] += len(started)
        for params in meta.declines:
            decline(self.decode, params)
        if self.prefill is not None:
            for send in meta.sends:
                if self._hand_over(send, finished=True):
                    self.counters["sends"] += 1

    def _hand_over(self, send: Send, *, finished: bool) -> bool:
        """Hand a request to the prefill side (its start, for layer-wise push, or its end). A refusal is logged,
        never raised into vLLM's model runner; a refused end is reported sent at once, so vLLM frees the blocks it
        kept for the decode (nothing will read them)."""
        assert self.prefill is not None
        tid = self._transfer_id(send)
        call = self.prefill.request_finished if finished else self.prefill.start_request
        try:
            call(tid, send.block_ids, send.num_tokens, token=send.token or None)
        except KvplaneError as e:
            logger.warning("kvplane: request %s was refused by the prefill side at its %s (%s); %s", send.request_id,
                           "end" if finished else "layer-wise start", e,
                           "its blocks go back to vLLM" if finished else "its end is handed over again")
            if finished:
                self._book.refused(tid)
            return False
        return True

    def _transfer_id(self, send: Send) -> str:
        tid = send.transfer_id or send.request_id
        self._book.handed(tid, send.request_id)
        return tid

    def _load(self, offload: OffloadEngine, meta: KVPlaneMetadata, in_store: Any = None) -> None:
        """A load kvplane refuses fails its blocks. A lookup's hold ends once its load holds the blocks itself,
        or when the scheduler releases it."""
        if meta.loads:
            waited = [j for j in meta.loads if j.wait_in_vllm]  # reported like receives (several groups)
            if self.tier_events is not None:
                self.tier_events.expect_loads(meta.loads)
            try:
                loaded = offload.start_loads([(j.request_id, j.hashes, j.block_ids) for j in meta.loads], in_store)
                self.counters["loads"] += len(meta.loads)
            except KvplaneError as e:
                logger.warning("kvplane: offload loads refused, their blocks will be recomputed: %s", e)
                self._load_errors.update(
                    b for j in meta.loads if not j.wait_in_vllm for ids in j.block_ids.values() for b in ids)
                self._failed_receives.extend(Completion(j.request_id, "failed", reason=str(e)) for j in waited)
                waited = []
            # which blocks a load could not fill is known once it started; ids may repeat across groups, so a
            # request sharing one with a failed load of another group recomputes too (never the reverse)
            errors = offload.get_block_ids_with_load_errors() if waited else set()
            for j in waited:
                self._book.loading(j.request_id, j.request_id not in loaded
                                   or any(b in errors for ids in j.block_ids.values() for b in ids))
        if self.holds is not None:
            for rid in [j.request_id for j in meta.loads] + meta.released:
                self.holds.release(rid)

    def _store(self, offload: OffloadEngine, meta: KVPlaneMetadata) -> None:
        """A store kvplane refuses is skipped (a later miss)."""
        for job in meta.stores:
            try:
                offload.start_store(job.request_id, job.hashes, job.block_ids, job.tags)
                self.counters["stores"] += 1
            except KvplaneError as e:
                logger.warning("kvplane: store of request %s skipped: %s", job.request_id, e)

    def _abort(self, rid: str) -> None:
        if self.offload is not None:
            with self._lock:
                self.offload.abort(rid)
                if self.holds is not None:
                    self.holds.release(rid)
        if self.prefill is not None:
            self.prefill.abort(self._book.transfer_id(rid))
        if self._book.abort(rid) and self.decode is not None:  # a receive runs: it reports once nothing lands
            self.decode.abort(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.offload is not None:
            with self._lock:
                self.offload.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        if self._step is not None and not self._step.loads:  # a step with loads calls start_load_kv first
            self._start_saves(self._step)
        if self.offload is not None:
            with self._lock:
                self.offload.save_layer(layer_name)
        if self.prefill is not None and self._pushing_layers:  # other steps have no layer to push
            self.prefill.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.offload is not None:
            with self._lock:
                self.offload.wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(sent or drained after an abort, received) request ids; failures also fill the load errors."""
        sending: set[str] = set()
        recving: set[str] = set()
        completions = list(self._failed_receives)
        self._failed_receives.clear()
        if self.offload is not None:
            with self._lock:
                _, loaded = self.offload.get_finished()  # stores and synchronous loads finish within their step
            for rid in sorted(loaded):  # this step's finished loads: the waited ones are reported like receives
                short = self._book.load_short(rid)
                if short is None:
                    continue
                completions.append(Completion(rid, "failed" if short else "done",
                                              reason="host-tier blocks gone since the lookup" if short else ""))
        sending.update(self._book.take_refused())
        if self.prefill is not None:
            for c in self.prefill.get_finished():
                sender = self._book.sent(c.request_id)
                if sender is None:  # vLLM asserts on an id it does not hold: a peer's stray or repeated completion
                    logger.warning("kvplane: request %s is not being sent from here (unknown, or reported "
                                   "already): its completion is dropped", c.request_id)
                    continue
                sending.add(sender)
        if self.decode is not None:
            received = finished_receives(self.decode, self._book.awaits_receive)  # skipped blocks: the instance's (rank 0)
            self.counters["receive_skipped_blocks"] += 0 if self.tp_rank else sum(c.skipped_blocks for c in received)
            completions += received
        for c in completions:
            if self._book.ended(c.request_id) == "sent":
                sending.add(c.request_id)  # vLLM was told to wait for it as a delayed free
                continue
            if not c.ok:
                self.counters["failed_receives"] += 1
                logger.warning("kvplane: request %s ended %s: %s", c.request_id, c.state, c.reason)
                if self.failures_by_request:
                    self._failed_requests.add(c.request_id)
                else:
                    self._load_errors.update(c.all_failed_block_ids())
            recving.add(c.request_id)
        return sending, recving

    def take_kv_events(self) -> list[Any]:  # vLLM's model runner takes them every step
        with self._lock:
            return self.tier_events.take() if self.tier_events is not None else []

    def take_failed_requests(self) -> set[str]:
        """Receives that failed, by request id (reported with ``get_finished``'s receives, or by the next call)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if self.offload is not None:
            with self._lock:
                offload_errors = self.offload.get_block_ids_with_load_errors()
            if not self.failures_by_request:  # else those loads are reported by request (get_finished)
                errors |= offload_errors
        self.counters["load_error_blocks"] += len(errors)
        return errors

    def held_request_ids(self) -> dict[str, set[str]]:
        """Every per-request table, by name: all empty once every request has ended (the tests check it)."""
        return {
            **self._book.held(), "worker.failed_requests": set(self._failed_requests),
            "worker.lookup_holds": self.holds.held_request_ids() if self.holds is not None else set(),
            "worker.failed_receives": {c.request_id for c in self._failed_receives},
        }

    def stats(self) -> dict[str, int]:
        """The counters since the last call (vLLM sums them over workers and intervals)."""
        out, self.counters = self.counters, dict.fromkeys(self.counters, 0)
        return out

    def host_blocks_in_use(self) -> int:
        if self.offload is None:
            return 0
        with self._lock:
            return self.offload.host_blocks_in_use()

    def shutdown(self) -> None:
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        self.holds = None
        for side in (self.prefill, self.decode):
            if side is not None:
                side.close()
        self.prefill = self.decode = None
        if self.offload is not None:
            with self._lock:
                self.offload.close()
                if self.tier_events is not None:  # the host tier's contents go with it (sleep mode)
                    self.tier_events.host_cleared()
            self.offload = None
