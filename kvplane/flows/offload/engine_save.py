"""``EngineSaves``: the device -> host half of ``OffloadEngine``: reserving host blocks, then saving layer by layer.

``start_store`` reserves host blocks for the blocks the host tier lacks and builds each group's D2H plan once;
``save_layer`` hands a layer's part of every open store to the save stream after that layer's compute. While
the save stream is still busy, layers wait and go as one copy (about ``SAVE_TASKS`` hand-offs per request,
``_save_batch``); a store whose last layer was handed over gets the event after it and waits in ``_saving``
until ``poll`` retires it.

``OffloadEngine`` builds these parts in its ``__init__``; this mixin only declares them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.blocks.groups import PerGroup
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.copier import LayerCopier
from kvplane.flows.offload.engine_lookup import EngineLookups
from kvplane.flows.offload.errors import OffloadError
from kvplane.flows.offload.jobs import GroupBlocks, StoreJob, paired
from kvplane.flows.offload.keyed_pool import as_hashes
from kvplane.flows.offload.layer_plans import LayerPlanner
from kvplane.flows.offload.listener import as_tags


class EngineSaves(EngineLookups):
    copier: LayerCopier
    _group_layers: dict[int, list[str]]
    _layer_pos: dict[str, tuple[int, int]]
    _group_layer_set: dict[int, frozenset[str]]
    _save_planner: dict[int, LayerPlanner]
    _open: dict[str, StoreJob]
    _saving: dict[str, StoreJob]
    _pending_saves: list[tuple[CopyPlan, int, int]]
    _save_batch: int
    _stored: set[str]

    def start_store(self, request_id: str, block_hashes: PerGroup, device_block_ids: PerGroup,
                    tags: Mapping[int, Sequence[Any]] | None = None) -> int:
        """Reserve host blocks for the request's blocks the host tier lacks; returns how many will be copied.

        Copies start with ``save_layer``. Blocks already cached are skipped (and become most recently used);
        when the pool cannot hold them all, the leading ones are stored. ``tags`` (per group, one per hash) go
        to the listener with the blocks once they are cached (``listener.TierListener.host_cached``).
        """
        self._check_new(request_id)
        before_evict = self.store.before_evict if self.store is not None else None
        groups: dict[int, GroupBlocks] = {}
        for g, (hash_list, device_ids) in paired(request_id, block_hashes, device_block_ids, self._group_ids).items():
            hashes = as_hashes(hash_list)  # once: the index and the job's finish read this array
            found, hits, _ = self.index.find(g, hashes)
            group_tags = None if tags is None or g not in tags else \
                as_tags(tags[g], len(hashes), f"start_store: request {request_id!r} group {g}")
            if hits:
                held = found >= 0
                cached = found[held]
                self.index.ref(g, cached)
                self.index.release(g, cached)  # touch: most recently used
                new, device_ids = hashes[~held], device_ids[~held]
                group_tags = group_tags[~held] if group_tags is not None else None
            else:  # nothing cached (a fresh prefix): the arrays as they are
                new = hashes
            ids = self.index.allocate(g, len(new), before_evict)
            if len(ids):
                kept = group_tags[: len(ids)] if group_tags is not None else None
                groups[g] = GroupBlocks(device_ids[: len(ids)], ids, new[: len(ids)], kept)
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

    def _check_new(self, request_id: str) -> None:
        if request_id in self._open or request_id in self._saving:
            raise OffloadError(
                f"request {request_id!r} is already storing; wait until get_finished() reports it before "
                f"storing it again"
            )
