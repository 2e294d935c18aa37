"""``EngineLoads``: the host -> device half of ``OffloadEngine``: gathering the available prefix, then loading it.

``start_loads`` pins each request's host runs, fetches its store runs into host blocks (``_gather``), and
enqueues every layer's H2D for all the requests at once, in model order, with an event after each layer;
``wait_for_layer`` makes the compute wait for that layer's event only. A load that finds fewer blocks than
asked loads the prefix it has and lists the rest as load errors.

``OffloadEngine`` builds these parts in its ``__init__``; this mixin only declares them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from kvplane.backend.base import Event
from kvplane.blocks.groups import Ids, PerGroup
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.copier import LayerCopier
from kvplane.flows.offload.engine_lookup import EngineLookups
from kvplane.flows.offload.errors import OffloadError
from kvplane.flows.offload.jobs import GroupBlocks, LoadJob, paired
from kvplane.flows.offload.keyed_pool import as_hashes
from kvplane.flows.offload.layer_plans import LayerPlanner
from kvplane.flows.offload.presence import BoolArray, InStore

LoadRequest = tuple[str, PerGroup, PerGroup]  # (request id, block hashes, device block ids)


class EngineLoads(EngineLookups):
    copier: LayerCopier
    _group_layers: dict[int, list[str]]
    _layer_pos: dict[str, tuple[int, int]]
    _load_planner: dict[int, LayerPlanner]
    _loading: dict[str, LoadJob]
    _layer_events: dict[str, Event]
    _load_errors: set[int]

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
