"""``EngineLookups``: what ``OffloadEngine`` answers without copying anything: tokens available, store presence.

A lookup reads the host index, then asks the store for the blocks after the host prefix; the available prefix
is a list of runs that alternate between the two tiers (``_runs``), which a load then gathers
(``engine_load.py``). The store can be asked first, outside the lock that guards the engine
(``store_presence``), and its answer kept for the same request's load (``remember_presence``), so a slow store
never holds up the engine's callers.

``OffloadEngine`` builds these parts in its ``__init__``; this mixin only declares them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvplane.blocks.groups import PerGroup, per_group
from kvplane.flows.offload.errors import OffloadError
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.keyed_pool import as_hashes
from kvplane.flows.offload.presence import BoolArray, InStore, LookupAnswers
from kvplane.flows.offload.spill import StoreLink
from kvplane.kv.spec import KVSpec
from kvplane.metrics import recorder


class EngineLookups:
    spec: KVSpec
    index: HostIndex
    store: StoreLink | None
    _group_ids: list[int]
    _layer_group: dict[str, int]
    _tokens_per_block: dict[int, int]
    _presence: LookupAnswers

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

    def _group_of(self, layer_name: str) -> int:
        try:
            return self._layer_group[layer_name]
        except KeyError:
            raise OffloadError(
                f"layer_name={layer_name!r} is not in the KV spec (first layers: {self.spec.layer_names[:3]}); "
                f"pass the names the engine registered its KV caches under"
            ) from None
