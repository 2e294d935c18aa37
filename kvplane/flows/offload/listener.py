"""``TierListener``: what the offload tiers tell an observer about blocks becoming loadable or going away.

The engine calls it on its own thread (the vLLM connector's worker, under its lock) at the moment a tier's
state changes, so each call must only record and return: the vLLM connector turns these calls into vLLM's KV
events (``integrations/vllm/events.py``). A block is reported cached once its copy completed and it is keyed
(a load can find it on its own), evicted just before its host block is reused, written once the store
answered its put with success, and missing when a get found no object under its key. ``tags`` are what the
caller passed beside the hashes to ``start_store`` (one per block, or None), handed back untouched.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import Ids
from kvplane.flows.offload.errors import OffloadError

Tags = npt.NDArray[np.object_]


class TierListener(Protocol):
    def host_cached(self, group: int, host_ids: Ids, tags: Tags | None) -> None:
        """Host blocks ``host_ids`` of ``group`` were filled and keyed; ``tags[i]`` belongs to ``host_ids[i]``."""

    def host_evicted(self, group: int, host_ids: Ids) -> None:
        """Keyed host blocks about to be reused for other prefixes: no load finds them any more."""

    def store_written(self, group: int, host_ids: Ids) -> None:
        """The store took the puts of these host blocks (still keyed and referenced while this runs)."""

    def store_missing(self, group: int, hashes: list[Any]) -> None:
        """A get found no object under these prefix hashes (the store evicted them, or never held them)."""


def as_tags(tags: Any, n: int, what: str) -> Tags:
    """``tags`` as a 1-d object array of ``n`` entries, or an ``OffloadError`` naming ``what``."""
    out = np.empty(n, dtype=object)
    values = list(tags)
    if len(values) != n:
        raise OffloadError(f"{what}: {len(values)} tags for {n} blocks; pass one tag per block hash")
    out[:] = values
    return out
