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

    Regions pair up in order and must have equal block bytes; the plan is coalesced.
    """
    src_ids = np.asarray(src_block_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64)
    if src_ids.shape != dst_ids.shape:
        raise PlanError(f"{src_ids.size} source block ids but {dst_ids.size} destination ids; pass equal counts")
    if len(src_regions) != len(dst_regions):
        raise PlanError(f"{len(src_regions)} source regions but {len(dst_regions)} destination regions")
    plans = []
    for s, d in zip(src_regions, dst_regions):
        if s.block_bytes != d.block_bytes:
            raise PlanError(
                f"layer {s.layer_name!r} slot {s.slot!r}: block bytes differ ({s.block_bytes} vs {d.block_bytes}); "
                f"a local block copy needs the same layout on both sides"
            )
        lengths = np.full(src_ids.size, s.block_bytes, dtype=np.int64)
        plans.append(CopyPlan(s.block_addrs(src_ids), d.block_addrs(dst_ids), lengths))
    return CopyPlan.concat(plans).coalesced()
