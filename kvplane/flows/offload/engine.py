"""``OffloadEngine``: the host tier (and optionally Mooncake Store behind it) behind plain methods an engine calls.

Who calls what (one thread, the engine's; nano-vllm calls the layer hooks from ``Attention.forward``, the vLLM
connector wraps them):

- scheduling: ``lookup(hashes)`` -> tokens available (no side effects); then ``start_load`` for those blocks.
- before a forward that writes blocks worth keeping: ``start_store(request_id, hashes, device_block_ids)``.
- in each attention layer: ``wait_for_layer(name)`` before reading the KV, ``save_layer(name)`` after writing it.
- after the forward: ``wait_for_save()``; each step: ``get_finished()`` -> (stored, loaded) request ids.
- ``abort(request_id)`` at any time; its host blocks are released once its copies have drained.

A request id appears in ``get_finished`` once kvplane no longer touches its device blocks (also after an
abort), so the engine may free or reuse them then, and not before. A load that finds fewer blocks than asked
(evicted since ``lookup``, a store that went away) loads the prefix it has, returns fewer tokens, and lists the
rest in ``get_block_ids_with_load_errors``.

This module builds the engine and retires its work (``poll``, ``abort``, ``close``); its other methods come
from three mixins over the same state: ``engine_lookup.py`` (lookups and store presence), ``engine_save.py``
(device -> host) and ``engine_load.py`` (host -> device).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait

from kvplane.backend.base import Event
from kvplane.descriptors import CopyPlan, Region
from kvplane.flows.offload.config import OffloadConfig
from kvplane.flows.offload.copier import LayerCopier
from kvplane.flows.offload.engine_load import EngineLoads, LoadRequest
from kvplane.flows.offload.engine_save import EngineSaves
from kvplane.flows.offload.host_pool import HostPool
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.jobs import LoadJob, StoreJob
from kvplane.flows.offload.keys import fingerprint
from kvplane.flows.offload.listener import TierListener
from kvplane.flows.offload.presence import LookupAnswers
from kvplane.flows.offload.spill import StoreLink, check_fits
from kvplane.flows.offload.store import StoreTier
from kvplane.kv.bound import BoundKV
from kvplane.metrics.watch import record_offload, watch_offload

__all__ = ["SAVE_TASKS", "LoadRequest", "OffloadEngine"]

SAVE_TASKS = 8  # see OffloadEngine._save_batch


class OffloadEngine(EngineSaves, EngineLoads):
    def __init__(self, kv: BoundKV, config: OffloadConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 store_tier: StoreTier | None = None) -> None:
        backend, spec, regions = kv.backend, kv.spec, kv.regions
        self.kv, self.backend, self.spec, self.config = kv, backend, spec, config  # kv: the tensors the regions borrow
        self.pool = HostPool(backend, regions, config.host_bytes, config.pinned)
        self.index = HostIndex(self.pool.block_bytes, self.pool.num_blocks)
        by_layer: dict[str, list[Region]] = {}
        for r in regions:
            by_layer.setdefault(r.layer_name, []).append(r)
        self.copier = LayerCopier(backend, by_layer, self.pool.regions)
        self._layer_group = {layer.name: layer.group_id for layer in spec.layers}
        self._group_ids = [g.group_id for g in spec.groups if g.group_id in self.pool.block_bytes]
        self._group_layers = {g: [n for n, lg in self._layer_group.items() if lg == g] for g in self._group_ids}
        # layer -> (its group, its index among the group's layers): where its part sits in a group's plan
        self._layer_pos = {n: (g, i) for g, names in self._group_layers.items() for i, n in enumerate(names)}
        self._group_layer_set = {g: frozenset(names) for g, names in self._group_layers.items()}
        self._tokens_per_block = {g.group_id: g.tokens_per_block for g in spec.groups}
        # each group's planners, looked up once here rather than by its 61 layer names in every request
        self._save_planner = {g: self.copier.save_planner(names) for g, names in self._group_layers.items()}
        self._load_planner = {g: self.copier.load_planner(names) for g, names in self._group_layers.items()}
        self.fingerprint = fingerprint(spec, regions, tp_rank, tp_size)
        self.store: StoreLink | None = None
        store_config = store_tier.config if store_tier is not None else config.store
        if store_config is not None:  # before a client sets up and lends its segment
            check_fits(store_config, self.pool.block_bytes)
        if store_tier is None and config.store is not None:
            store_tier = StoreTier(config.store)
        if store_tier is not None:
            self.store = StoreLink(store_tier, self.index, self.pool, self.fingerprint)
        watch_offload(self)
        self._open: dict[str, StoreJob] = {}  # some layers not yet enqueued
        self._saving: dict[str, StoreJob] = {}  # every copy enqueued (or aborted): waiting for the event
        self._loading: dict[str, LoadJob] = {}
        self._layer_events: dict[str, Event] = {}
        # layers saved while the save stream was busy, not yet enqueued: (plan, begin, end) parts of job plans
        self._pending_saves: list[tuple[CopyPlan, int, int]] = []
        # layers an idle save stream waits for before they go as one task: a request's store is at most about
        # SAVE_TASKS hand-offs to the copy stream, however many layers (61 for DeepSeek-V3)
        self._save_batch = max(1, -(-len(self._layer_group) // SAVE_TASKS))
        self._stored: set[str] = set()
        self._loaded: set[str] = set()
        self._load_errors: set[int] = set()
        self._presence = LookupAnswers()  # a load of the same request and keys reads these, not the store
        self.listener: TierListener | None = None  # told when blocks become loadable or go (``listen``)

    def listen(self, listener: TierListener) -> None:
        """Tell ``listener`` from now on when host blocks are cached or evicted and store objects written or found
        missing (the vLLM connector's KV events). Nothing is tracked for it before."""
        self.listener = self.index.listener = listener
        if self.store is not None:
            self.store.listener = listener

    # -- waiting, completion and aborts -------------------------------------------------------------------
    def wait_for_save(self) -> None:
        """Enqueue the layers no ``save_layer`` covered, then block until every store's copies are done."""
        if self._open:  # in model order, as a forward would have saved them
            left = set().union(*(j.layers_left for j in self._open.values()))
            for name in [n for n in self._layer_group if n in left]:
                self.save_layer(name)
        for job in self._saving.values():
            if job.event is not None:
                job.event.synchronize()
        self.poll()

    def poll(self) -> None:
        """Retire completed stores and loads, and store calls; never blocks."""
        for rid, job in list(self._saving.items()):
            if job.event is None or job.event.query():
                del self._saving[rid]
                self._finish_store(job)
        for rid, load in list(self._loading.items()):
            if load.event is None or load.event.query():
                del self._loading[rid]
                if load.plan is not None:  # its event completed: no copy reads the plan any more
                    self.copier.recycle(load.plan)
                record_offload(self, load, "read")
                for g, blocks in load.groups.items():
                    self.index.release(g, blocks.host_ids)
                self._loaded.add(rid)
        if self.store is not None:
            self.store.poll()

    def _finish_store(self, job: StoreJob) -> None:
        for plan, _ in job.plans.values():  # its event completed: no copy reads these plans any more
            self.copier.recycle(plan)
        record_offload(self, job, "write")
        for g, blocks in job.groups.items():
            if job.aborted:
                self.index.release(g, blocks.host_ids)
                continue
            keyed = self.index.cache(g, blocks.host_ids, blocks.hashes)
            if self.listener is not None and keyed.any():  # before a write-through put: it reports on these
                self.listener.host_cached(g, blocks.host_ids[keyed],
                                          blocks.tags[keyed] if blocks.tags is not None else None)
            if self.store is not None and self.store.write_through and keyed.any():
                self.store.write(g, blocks.host_ids[keyed], blocks.hashes[keyed].tolist())
                self.index.release(g, blocks.host_ids[~keyed])
            else:
                self.index.release(g, blocks.host_ids)
        self._stored.add(job.request_id)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose stores, and whose loads, finished (or drained after an abort) since the last call."""
        self.poll()
        stored, loaded = self._stored, self._loaded
        self._stored, self._loaded = set(), set()
        return stored, loaded

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids a load was asked for but could not fill since the last call (recompute them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def abort(self, request_id: str) -> None:
        """Stop a request's store or load: nothing more is enqueued, its host blocks go once its copies drain."""
        if request_id in self._open:
            job = self._open.pop(request_id)
            job.aborted = True
            self._flush_saves()  # its blocks are released only after every copy into them
            job.event = self.copier.mark(self.copier.save_stream)
            self._saving[request_id] = job
        elif request_id in self._saving:
            self._saving[request_id].aborted = True
        if request_id in self._loading:
            self._loading[request_id].aborted = True  # its blocks were never keyed by this load: released as is

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until every copy and store call has completed (tests, the bench, shutdown); bounded."""
        self.wait_for_save()
        self.copier.load_stream.synchronize()
        deadline = time.monotonic() + timeout_s
        self.poll()
        while self.store is not None and self.store.in_flight and time.monotonic() < deadline:
            # wake when a call completes rather than on a polling tick; the short cap re-checks deadlines
            wait(self.store.futures(), min(0.05, max(0.0, deadline - time.monotonic())), FIRST_COMPLETED)
            self.poll()

    def close(self) -> None:
        """Finish in-flight copies, stop the copy streams, close the store client (bounded; an unreachable one
        is abandoned). Host blocks still referenced by a store call that never returned stay allocated."""
        self.wait_idle(timeout_s=self.config.store.timeout_s if self.config.store else 1.0)
        for stream in (self.copier.save_stream, self.copier.load_stream):
            stop = getattr(stream, "close", None)  # the cpu backend's worker streams own a thread
            if callable(stop):
                stop()
        if self.store is not None:
            self.store.tier.close()
