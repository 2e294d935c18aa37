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
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, wait

import numpy as np

from kvplane.backend.base import Backend, Event
from kvplane.blocks.groups import Ids, PerGroup, per_group
from kvplane.descriptors import CopyPlan, Region
from kvplane.flows.offload.config import OffloadConfig
from kvplane.flows.offload.copier import LayerCopier
from kvplane.flows.offload.errors import OffloadError
from kvplane.flows.offload.host_pool import HostPool
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.jobs import GroupBlocks, LoadJob, StoreJob, paired
from kvplane.flows.offload.keyed_pool import as_hashes
from kvplane.flows.offload.keys import fingerprint
from kvplane.flows.offload.presence import BoolArray, InStore, LookupAnswers
from kvplane.flows.offload.spill import StoreLink, check_fits
from kvplane.flows.offload.store import StoreTier
from kvplane.kv.binding import LayoutChoice, regions_from_tensors
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec
from kvplane.metrics import recorder
from kvplane.metrics.watch import record_offload, watch_offload

SAVE_TASKS = 8  # see OffloadEngine._save_batch
LoadRequest = tuple[str, PerGroup, PerGroup]  # (request id, block hashes, device block ids)


class OffloadEngine:
    def __init__(
        self,
        backend: Backend,
        spec: KVSpec,
        kv_caches: Mapping[str, LayerValue],
        config: OffloadConfig,
        *,
        layouts: LayoutChoice | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        store_tier: StoreTier | None = None,
    ) -> None:
        self.backend, self.spec, self.config = backend, spec, config
        self._kv_caches = kv_caches  # borrowed: the regions point into these tensors
        regions = regions_from_tensors(spec, kv_caches, layouts if layouts is not None else backend.layouts)
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

    # -- queries ------------------------------------------------------------------------------------------
    def lookup(self, block_hashes: PerGroup, in_store: InStore | None = None) -> int:
        """Leading tokens available in the host tier, then the store: the fewest over the model's groups.
        ``in_store``: what ``store_presence`` answered for the same hashes, so the store is not asked again here
        (the caller asked it outside the lock that guards this engine)."""
        tokens: int | None = None
        queried = 0
        for g, hashes in per_group("block_hashes", block_hashes, self._group_ids, OffloadError).items():
            runs = self._runs(g, hashes.tolist(), None if in_store is None else in_store.get(g))
            t = sum(count for _, count in runs) * self._tokens_per_block[g]
            tokens = t if tokens is None else min(tokens, t)
            queried = max(queried, len(hashes) * self._tokens_per_block[g])
        recorder().lookup(queried, tokens or 0)
        return tokens or 0

    def store_presence(self, block_hashes: PerGroup) -> InStore | None:
        """Which blocks the store tier holds, per group (None without a store tier). It asks the store only, so
        it may run on any thread without this engine's lock: a lookup asks it first, then takes the lock for
        ``lookup(block_hashes, in_store)``, and a slow store never holds up the engine's callers."""
        store = self.store
        if store is None:
            return None
        found = {}
        for g, hashes in per_group("block_hashes", block_hashes, self._group_ids, OffloadError).items():
            present = store.exists(g, hashes.tolist())
            found[g] = np.zeros(len(hashes), dtype=bool) if present is None else np.asarray(present, dtype=bool)
        return found

    def remember_presence(self, request_id: str, block_hashes: PerGroup, in_store: InStore) -> None:
        """Keep what ``store_presence`` answered for a request's lookup, for its load (``forget_presence``
        drops it: the connector's holds do, when the load took its blocks or the request will not load)."""
        hashes = {g: as_hashes(h) for g, h in per_group("block_hashes", block_hashes, self._group_ids,
                                                        OffloadError).items()}
        self._presence.remember(request_id, hashes, in_store)

    def forget_presence(self, request_id: str) -> None:
        self._presence.forget(request_id)

    def loads_presence(self, requests: Iterable[tuple[str, PerGroup]]) -> dict[str, InStore]:
        """The store's answer for loads that have no remembered one (``remember_presence``), asked now: call it
        without the lock that guards this engine and hand it to ``start_loads``. Empty without a store tier."""
        if self.store is None:
            return {}
        asked = {}
        for rid, hashes in requests:
            groups = per_group("block_hashes", hashes, self._group_ids, OffloadError)
            if any(self._presence.find(rid, g, as_hashes(h)) is None for g, h in groups.items()):
                found = self.store_presence(hashes)
                if found is not None:
                    asked[rid] = found
        return asked

    def _runs(self, group: int, hashes: list[int], in_store: BoolArray | None = None) -> list[tuple[bool, int]]:
        """The available prefix as runs ``(in_store, count)``: host runs and store runs alternate."""
        runs: list[tuple[bool, int]] = []
        n = 0
        while n < len(hashes):
            in_host = self.index.cached_prefix(group, hashes[n:])
            if in_host:
                runs.append((False, in_host))
                n += in_host
            if n >= len(hashes):
                break
            if in_store is not None:
                rest = in_store[n:]
                found = int(rest.size if rest.all() else rest.argmin())
            else:
                found = self.store.count_prefix(group, hashes[n:]) if self.store is not None else 0
            if not found:
                break
            runs.append((True, found))
            n += found
        return runs

    def host_blocks_in_use(self) -> int:
        """Host blocks referenced now (being stored, loaded or written to the store)."""
        return self.index.num_referenced()

    # -- store: device -> host ----------------------------------------------------------------------------
    def start_store(self, request_id: str, block_hashes: PerGroup, device_block_ids: PerGroup) -> int:
        """Reserve host blocks for the request's blocks the host tier lacks; returns how many will be copied.

        Copies start with ``save_layer``. Blocks already cached are skipped (and become most recently used);
        when the pool cannot hold them all, the leading ones are stored.
        """
        self._check_new(request_id)
        before_evict = self.store.before_evict if self.store is not None else None
        groups: dict[int, GroupBlocks] = {}
        for g, (hash_list, device_ids) in paired(request_id, block_hashes, device_block_ids, self._group_ids).items():
            hashes = as_hashes(hash_list)  # once: the index and the job's finish read this array
            found, hits, _ = self.index.find(g, hashes)
            if hits:
                held = found >= 0
                cached = found[held]
                self.index.ref(g, cached)
                self.index.release(g, cached)  # touch: most recently used
                new, device_ids = hashes[~held], device_ids[~held]
            else:  # nothing cached (a fresh prefix): the arrays as they are
                new = hashes
            ids = self.index.allocate(g, len(new), before_evict)
            if len(ids):
                groups[g] = GroupBlocks(device_ids[: len(ids)], ids, new[: len(ids)])
        layers = set().union(*(self._group_layer_set[g] for g in groups))
        job = StoreJob(request_id, groups, layers)
        for g, blocks in groups.items():
            planner = self._save_planner[g]
            job.plans[g] = planner.parts(blocks.device_ids, blocks.host_ids)
            if planner.merged:
                job.merged_left[g] = len(self._group_layers[g])
        if layers:
            self._open[request_id] = job
        else:
            self._stored.add(request_id)
        return sum(len(b.host_ids) for b in groups.values())

    def save_layer(self, layer_name: str) -> None:
        """After layer ``layer_name`` wrote its KV: enqueue its D2H for every open store (returns at once)."""
        pos = self._layer_pos.get(layer_name)
        if pos is None or not self._open:
            self._group_of(layer_name)  # an unknown name raises; a layer of a group without host blocks is a no-op
            return
        g, i = pos
        pending = self._pending_saves  # called once per layer and request: no list or lookup it can do without
        done: list[StoreJob] | None = None
        for j in self._open.values():
            left = j.layers_left
            if layer_name not in left:
                continue
            left.remove(layer_name)
            if g not in j.merged_left:
                plan, bounds = j.plans[g]
                pending.append((plan, bounds[i], bounds[i + 1]))
            else:  # one plan for every layer of the group: it goes once the last of them was saved
                j.merged_left[g] -= 1
                if not j.merged_left[g]:
                    plan = j.plans[g][0]
                    pending.append((plan, 0, len(plan)))
            if not left:
                done = [j] if done is None else [*done, j]
        if not pending:
            return
        if done is not None or (len(pending) >= self._save_batch and self.copier.save_stream.query()):
            self._flush_saves()
        if done is not None:
            event = self.copier.mark(self.copier.save_stream)
            for j in done:
                j.event = event
                self._saving[j.request_id] = self._open.pop(j.request_id)

    def _flush_saves(self) -> None:
        """Enqueue the D2H of every layer saved since the last flush as one copy, after the compute so far.

        While the save stream is still copying earlier layers, later layers wait here and then go as one part:
        they could not have started sooner, and one call per batch instead of per layer matters where a copy
        call is costly (the cpu backend's worker, a busy host). Consecutive layers of one request are one range
        of its plan; anything else is concatenated. Layers of one plan never overlap in memory.
        """
        if not self._pending_saves:
            return
        parts, self._pending_saves = self._pending_saves, []
        after = self.copier.after_compute()  # every pending layer's compute was enqueued before this point
        plan, begin, end = parts[0]
        if all(p is plan and a == prev_end for (p, a, _), (_, _, prev_end) in zip(parts[1:], parts)):
            self.copier.save_range(plan, begin, parts[-1][2], after)
            return
        joined = CopyPlan.concat([CopyPlan(p.src[a:b], p.dst[a:b], p.length[a:b]) for p, a, b in parts])
        self.copier.save_range(joined, 0, len(joined), after)

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

    # -- load: host -> device -----------------------------------------------------------------------------
    def start_load(self, request_id: str, block_hashes: PerGroup, device_block_ids: PerGroup) -> int:
        """Enqueue the H2D of every layer, in order; returns the tokens that will be loaded."""
        return self.start_loads([(request_id, block_hashes, device_block_ids)])[request_id]

    def start_loads(self, requests: Iterable[LoadRequest], in_store: Mapping[str, InStore] | None = None
                    ) -> dict[str, int]:
        """``start_load`` for several requests at once: one copy per layer covers all of them. Which blocks the
        store holds comes from ``in_store`` (``loads_presence``), else from the request's lookup
        (``remember_presence``), and only failing both from a store call made here."""
        jobs = [self._prepare_load(rid, hashes, ids, (in_store or {}).get(rid)) for rid, hashes, ids in requests]
        by_group: dict[int, tuple[CopyPlan, list[int]]] = {}
        for g in self._group_layers:
            parts = [j.groups[g] for j in jobs if g in j.groups]
            if len(parts) == 1:  # one request (the usual step): its ids as they are
                by_group[g] = self._load_planner[g].sliced_parts(parts[0].host_ids, parts[0].device_ids)
            elif parts:
                host_ids = np.concatenate([p.host_ids for p in parts])
                device_ids = np.concatenate([p.device_ids for p in parts])
                by_group[g] = self._load_planner[g].sliced_parts(host_ids, device_ids)
        if len(by_group) == 1:  # one group: its layers are in model order already, its plan goes as it is
            ((g, (plan, bounds)),) = by_group.items()
            names = self._group_layers[g]
        else:  # model order across groups: layer i's copy is queued before layer i+1's
            names = [n for n in self._layer_group if self._layer_pos[n][0] in by_group]
            pieces = []
            for n in names:
                g, i = self._layer_pos[n]
                p, b = by_group[g]
                pieces.append(CopyPlan(p.src[b[i] : b[i + 1]], p.dst[b[i] : b[i + 1]], p.length[b[i] : b[i + 1]]))
            plan = CopyPlan.concat(pieces)
            bounds = np.concatenate(([0], np.cumsum([len(p) for p in pieces], dtype=np.int64))).tolist()
            for p, _ in by_group.values():  # copied into ``plan``: nothing reads them any more
                self.copier.recycle(p)
        if names:
            self._layer_events.update(zip(names, self.copier.load_all(plan, bounds)))
            jobs[0].plan = plan
        final = self.copier.mark(self.copier.load_stream)
        out = {}
        for j in jobs:
            j.event = final
            self._loading[j.request_id] = j
            out[j.request_id] = j.tokens
        return out

    def _prepare_load(self, request_id: str, block_hashes: PerGroup, device_block_ids: PerGroup,
                      in_store: InStore | None = None) -> LoadJob:
        if request_id in self._loading:
            raise OffloadError(f"request {request_id!r} is already loading; wait for it in get_finished()")
        job = LoadJob(request_id, {})
        tokens: list[int] = []
        for g, (hashes, device_ids) in paired(request_id, block_hashes, device_block_ids, self._group_ids).items():
            keys = as_hashes(hashes)  # once: the host index reads this array
            found = in_store.get(g) if in_store is not None else None
            if found is None or len(found) != len(keys):
                found = self._presence.find(request_id, g, keys)
            host_ids = self._gather(g, hashes, keys, found)
            m = len(host_ids)
            if m:
                job.groups[g] = GroupBlocks(device_ids[:m], host_ids, keys[:m])
            if m < len(hashes):
                job.error_block_ids[g] = device_ids[m:].tolist()
                self._load_errors.update(job.error_block_ids[g])
            tokens.append(m * self._tokens_per_block[g])
        job.tokens = min(tokens) if tokens else 0
        return job

    def _gather(self, group: int, hashes: list[int], keys: Ids, held: BoolArray | None = None) -> Ids:
        """Referenced host blocks for the available prefix of ``hashes`` (``keys``: the same as an array),
        fetching store runs into the host; ``held``: which of them the store held when asked (else asked
        here)."""
        if self.store is None:  # the host prefix only: one pass over the hashes finds and pins it
            found, _, prefix = self.index.find(group, keys)
            ids = found[:prefix]
            self.index.ref(group, ids)
            return ids
        runs = self._runs(group, hashes, held)
        parts: list[Ids] = []
        n = 0
        for in_store, count in runs:  # pin every host run first, so fetching cannot evict them
            if not in_store:
                parts.append(self.index.pin(group, hashes[n : n + count]))
            else:
                parts.append(np.zeros(0, dtype=np.int64))
            n += count
        n = 0
        for i, (in_store, count) in enumerate(runs):
            if i >= len(parts):  # blocks were shed for an earlier fetch: the prefix ends before this run
                break
            if in_store and self.store is not None:
                short = count - self.index.pools[group].num_free
                if short > 0:  # unpin the prefix's last blocks, just enough to give the fetch its room
                    parts = self._shed(group, parts, i + 1, short)
                parts[i] = self.store.fetch(group, hashes[n : n + count])
                if len(parts[i]) < count:  # the store came up short: the prefix ends here
                    self._release_runs(group, parts[i + 1 :])
                    parts = parts[: i + 1]
                    break
            n += count
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _shed(self, group: int, parts: list[Ids], start: int, count: int) -> list[Ids]:
        """Release up to ``count`` pinned blocks from the end of ``parts[start:]``; the prefix ends there."""
        parts = list(parts)
        while count > 0 and len(parts) > start:
            last = parts[-1]
            k = min(count, len(last))
            self.index.release(group, last[len(last) - k :])
            count -= k
            if k == len(last):
                parts.pop()
            else:
                parts[-1] = last[: len(last) - k]
        return parts

    def _release_runs(self, group: int, runs: list[Ids]) -> None:
        for ids in runs:
            self.index.release(group, ids)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name`` reads its KV: wait for that layer's H2D only (later layers keep copying)."""
        event = self._layer_events.pop(layer_name, None)
        if event is None:
            self._group_of(layer_name)  # an unknown name raises
        elif not event.query():  # a layer already copied costs no wait (no lock, no sync)
            self.copier.order_compute_after(event)

    # -- completion and aborts ----------------------------------------------------------------------------
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

    # -- helpers ------------------------------------------------------------------------------------------
    def _group_of(self, layer_name: str) -> int:
        try:
            return self._layer_group[layer_name]
        except KeyError:
            raise OffloadError(
                f"layer_name={layer_name!r} is not in the KV spec (first layers: {self.spec.layer_names[:3]}); "
                f"pass the names the engine registered its KV caches under"
            ) from None

    def _check_new(self, request_id: str) -> None:
        if request_id in self._open or request_id in self._saving:
            raise OffloadError(
                f"request {request_id!r} is already storing; wait until get_finished() reports it before "
                f"storing it again"
            )
