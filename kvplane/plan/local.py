"""Local block-copy plans: the same blocks of matching regions, e.g. device cache -> host pool.

The cpu backend's bench, the offload flow and the conformance suite build plans here. Inter-rank plans with
heterogeneous TP, block sizes and layouts belong to the planner, which emits the same ``CopyPlan``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvplane.descriptors import CopyPlan, Region
from kvplane.errors import PlanError


def block_copy_plan(
    src_regions: Sequence[Region],
    src_block_ids: npt.ArrayLike,
    dst_regions: Sequence[Region],
    dst_block_ids: npt.ArrayLike,
) -> CopyPlan:
    """Copy block ``src_block_ids[i]`` of every source region into ``dst_block_ids[i]`` of its pair.

    Regions pair up in order and must have equal block bytes and row layout; the plan is coalesced, one
    descriptor per block across all layers where both sides are cross-layer caches.
    """
    src_ids = np.asarray(src_block_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64)
    if src_ids.shape != dst_ids.shape:
        raise PlanError(f"{src_ids.size} source block ids but {dst_ids.size} destination ids; pass equal counts")
    if len(src_regions) != len(dst_regions):
        raise PlanError(f"{len(src_regions)} source regions but {len(dst_regions)} destination regions")
    plans = []
    for s, d in zip(src_regions, dst_regions):
        if (s.block_bytes, s.row_bytes, s.parts, s.order) != (d.block_bytes, d.row_bytes, d.parts, d.order):
            raise PlanError(
                f"layer {s.layer_name!r} slot {s.slot!r}: blocks differ ({s.block_bytes} B {s.order} rows of "
                f"{s.row_bytes} B vs {d.block_bytes} B {d.order} rows of {d.row_bytes} B); a local block copy "
                f"needs the same layout and memory order on both sides"
            )
        lengths = np.full(src_ids.size, s.block_bytes, dtype=np.int64)
        plans.append(CopyPlan(s.block_addrs(src_ids), d.block_addrs(dst_ids), lengths))
    return CopyPlan.merge_parallel(plans).coalesced()
