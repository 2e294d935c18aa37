"""Host blocks held for what the scheduler's lookups promised, on the worker that answers them (TP rank 0).

With async scheduling vLLM schedules step N+1 (and asks ``get_num_new_matched_tokens``) while step N runs, so
step N's stores could evict host blocks a lookup just promised, and the load would fail. ``LookupHolds.hold``
answers a lookup and references the host blocks of the answered prefix, so no store can evict them, until
``release``: the worker calls it once the load has taken references of its own (``start_loads``), and when the
scheduler says the request will not load them (finished, preempted, or vLLM used fewer tokens:
``KVPlaneMetadata.released``). A newer lookup for the same request replaces its hold. Held bytes are bounded:
a lookup whose hold would pass ``max_bytes`` answers 0 tokens (a logged miss) rather than promise what a store
may evict. Store-tier blocks are not held (the store keeps its own leases), but what the store answered is kept
with the hold (``OffloadEngine.remember_presence``): the load reads it instead of asking the store again under
the engine's lock. Called under the engine's lock.
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from kvplane.flows.offload import OffloadEngine
from kvplane.flows.offload.presence import InStore

logger = logging.getLogger("kvplane.vllm")
HELD_SHARE = 0.5  # of the host tier, at most, held for promised lookups: stores keep the other half


class LookupHolds:
    def __init__(self, offload: OffloadEngine, max_bytes: int | None = None) -> None:
        self.offload = offload
        self.max_bytes = int(offload.pool.nbytes * HELD_SHARE) if max_bytes is None else max_bytes
        self._held: dict[str, dict[int, npt.NDArray[np.int64]]] = {}
        self.held_bytes = 0

    def hold(self, request_id: str, hashes: dict[int, list[int]], block_tokens: dict[int, int],
             in_store: InStore | None = None) -> int:
        """Leading tokens the tiers hold for ``hashes`` (per KV-cache group), their host blocks held for the
        request; 0 when holding them would pass the bound. ``in_store``: the store tier's answer for the same
        hashes, asked before the caller took the engine's lock (``OffloadEngine.store_presence``)."""
        self.release(request_id)
        tokens = self.offload.lookup(hashes, in_store)
        if tokens <= 0:
            return 0
        index, pool = self.offload.index, self.offload.pool
        want: dict[int, list[int]] = {}
        for g, group_hashes in hashes.items():
            leading = group_hashes[: tokens // block_tokens[g]]
            want[g] = leading[: index.cached_prefix(g, leading)]
        nbytes = sum(len(h) * pool.block_bytes[g] for g, h in want.items())
        if self.held_bytes + nbytes > self.max_bytes:
            logger.warning(
                "kvplane: lookup for request %s answers a miss: holding its %d host blocks (%d B) until the load "
                "would pass the bound of %d B held for promised lookups (%d B held now, %.0f%% of the host tier); "
                "give the offload tier more host_bytes", request_id, sum(len(h) for h in want.values()), nbytes,
                self.max_bytes, self.held_bytes, HELD_SHARE * 100,
            )
            return 0
        self._held[request_id] = {g: index.pin(g, h) for g, h in want.items() if h}
        self.held_bytes += nbytes
        if in_store is not None:  # the load reads it rather than asking the store again under the lock
            self.offload.remember_presence(request_id, hashes, in_store)
        return tokens

    def release(self, request_id: str) -> None:
        """End the request's hold (nothing if it has none)."""
        self.offload.forget_presence(request_id)
        held = self._held.pop(request_id, None)
        for g, ids in (held or {}).items():
            self.offload.index.release(g, ids)
            self.held_bytes -= len(ids) * self.offload.pool.block_bytes[g]

    def held_request_ids(self) -> set[str]:
        return set(self._held)
