"""What the engine tracks per request: which device blocks pair with which host blocks, and how far copying got.

A ``StoreJob`` is open while some of its layers have not been enqueued, then in flight until the event after
its last layer completes; a ``LoadJob`` is in flight from ``start_load`` until its last layer's event. An
aborted job enqueues nothing more and is drained: its host blocks are released once the event recorded at
abort time (after every copy it had enqueued) completes. ``paired`` checks what callers pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplane.backend.base import Event
from kvplane.blocks.groups import Ids, PerGroup, per_group
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.errors import OffloadError


@dataclass
class GroupBlocks:
    """Block ``device_ids[i]`` pairs with host block ``host_ids[i]``, whose prefix hash is ``hashes[i]``."""

    device_ids: Ids
    host_ids: Ids
    hashes: Ids
    tags: Any = None  # a store's caller's tag per block (an object array, ``listener.Tags``), handed to the listener


@dataclass
class StoreJob:
    request_id: str
    groups: dict[int, GroupBlocks]
    layers_left: set[str]
    # each group's D2H, built at start_store: one plan, and the bounds of each of the group's layers in it
    plans: dict[int, tuple[CopyPlan, list[int]]] = field(default_factory=dict)
    event: Event | None = None  # after the last enqueued copy, once no layer is left or on abort
    aborted: bool = False
    # groups whose plan covers every layer at once (cross-layer caches): layers of each still to be saved
    merged_left: dict[int, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # the metrics' transfer latency


@dataclass
class LoadJob:
    request_id: str
    groups: dict[int, GroupBlocks]
    event: Event | None = None
    aborted: bool = False
    started: float = field(default_factory=time.monotonic)  # the metrics' transfer latency
    tokens: int = 0  # leading tokens this load fills (the fewest over the groups asked for)
    error_block_ids: dict[int, list[int]] = field(default_factory=dict)
    # the plan its H2D runs (shared by the loads started with it; held by one of them), recycled at retirement
    plan: CopyPlan | None = None


def paired(
    request_id: str, hashes: PerGroup, device_ids: PerGroup, group_ids: Sequence[int]
) -> dict[int, tuple[list[int], Ids]]:
    """Hashes and device ids per group, checked to pair up one to one."""
    hs: dict[int, list[int]]
    if type(hashes) is list and len(group_ids) == 1:  # one group's hashes as a list: no array round trip
        hs = {group_ids[0]: hashes}
    else:
        hs = {g: v.tolist() for g, v in per_group("block_hashes", hashes, group_ids, OffloadError).items()}
    ds = per_group("device_block_ids", device_ids, group_ids, OffloadError)
    if set(hs) != set(ds):
        raise OffloadError(
            f"request {request_id!r}: block_hashes has groups {sorted(hs)}, device_block_ids {sorted(ds)}; "
            f"pass the same groups to both"
        )
    out = {}
    for g in hs:
        if len(hs[g]) != len(ds[g]):
            raise OffloadError(
                f"request {request_id!r} group {g}: {len(hs[g])} block hashes but {len(ds[g])} device block ids; "
                f"pass one device block per hashed (full) block"
            )
        out[g] = (hs[g], ds[g])
    return out
