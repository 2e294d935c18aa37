"""The per-pool hit policies of SGLang's ``batch_exists_v2``, over arrays (``mem_cache/hicache_storage.py``).

SGLang asks, for a prefix of ``kv_pages`` KV pages, which prefix lengths every side pool can restore too:

- ``all_pages``: the pool needs every page of the prefix (a DSA indexer): lengths up to its first missing page.
- ``trailing_pages``: the pool needs only the last ``trailing`` pages (Mamba or SWA state): a length works when
  the window ending there is whole, so the usable lengths can have holes.
- ``block_groups``: neither SGLang's own Mooncake nor its file backend serves it; this backend answers a miss
  (``restorable`` returns None) rather than guess.

The caller intersects the pools' masks: the usable lengths are where all of them hold.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"

Bools = npt.NDArray[np.bool_]


def restorable(policy: str, found: Bools, kv_pages: int, trailing: int = 1) -> Bools | None:
    """For each prefix length ``1..kv_pages``, whether a pool whose pages ``found`` says it holds can restore
    it under ``policy``; None for a policy this backend does not serve."""
    held = np.asarray(found, dtype=bool)[:kv_pages]
    if held.size < kv_pages:
        held = np.concatenate([held, np.zeros(kv_pages - held.size, dtype=bool)])
    if policy == ALL_PAGES:
        return np.logical_and.accumulate(held) if kv_pages else np.zeros(0, dtype=bool)
    if policy == TRAILING_PAGES:
        misses = np.concatenate([[0], np.cumsum(~held)])
        ends = np.arange(1, kv_pages + 1)
        starts = np.maximum(0, ends - max(1, trailing))
        return misses[ends] - misses[starts] == 0  # type: ignore[no-any-return]
    return None


def longest(mask: Bools) -> int:
    """The longest prefix length ``mask`` allows (0 when none)."""
    allowed = np.flatnonzero(mask)
    return int(allowed[-1]) + 1 if allowed.size else 0
