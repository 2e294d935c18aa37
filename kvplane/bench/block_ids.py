"""Block ids a bench request uses, and the per-block descriptors a raw engine would move for them.

``scatter``: a random half of a cache twice the request's size, in random order (the worst case for
coalescing). ``runs``: what a fresh request's block table mostly looks like: runs of consecutive ids (mean
``MEAN_RUN`` blocks, geometric lengths) in random order, so the planner can coalesce adjacent blocks.

``per_block_plan`` is the baseline's descriptor list: one descriptor per block and region, as vLLM's
per-layer blocks are, with no coalescing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.descriptors import CopyPlan, Region

Pattern = Literal["scatter", "runs"]
PATTERNS: tuple[Pattern, ...] = ("scatter", "runs")
MEAN_RUN = 32


def request_ids(pattern: Pattern, total: int, n: int, rng: np.random.Generator) -> Ids:
    """``n`` distinct ids out of ``0..total-1`` in the given pattern."""
    if pattern == "scatter":
        return rng.choice(total, n, replace=False).astype(np.int64)
    cuts = np.cumsum(rng.geometric(1.0 / MEAN_RUN, size=total))
    cuts = cuts[cuts < total]
    runs = np.split(np.arange(total, dtype=np.int64), cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])[:n]


def per_block_plan(src: Sequence[Region], src_ids: Ids, dst: Sequence[Region], dst_ids: Ids) -> CopyPlan:
    """Block ``src_ids[i]`` of every source region into block ``dst_ids[i]`` of its twin, one descriptor each."""
    s_base = np.array([r.addr for r in src], dtype=np.int64)[:, None]
    s_stride = np.array([r.block_stride for r in src], dtype=np.int64)[:, None]
    d_base = np.array([r.addr for r in dst], dtype=np.int64)[:, None]
    d_stride = np.array([r.block_stride for r in dst], dtype=np.int64)[:, None]
    length = np.array([r.block_bytes for r in src], dtype=np.int64)[:, None]
    n = len(src_ids)
    return CopyPlan(
        (s_base + src_ids[None, :] * s_stride).ravel(),
        (d_base + dst_ids[None, :] * d_stride).ravel(),
        np.broadcast_to(length, (len(src), n)).ravel().copy(),
    )
