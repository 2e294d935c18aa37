"""What a prefix hit is worth to ``--policy kv-aware``, against load: the router's constants, in one place.

A block the instance holds saves its prompt tokens' compute, less the cost of bringing the block to the device:
nothing from the device tier, a host-to-device copy from the CPU tier (tens of GB/s), a fetch over the network
from the store tier. ``TIER_WEIGHTS`` scale each hit token by that; ``LOAD_TOKENS`` is what one request already
outstanding on an instance costs, in prompt tokens computed. An instance's value is its weighted hit tokens less
``LOAD_TOKENS`` per outstanding request; the highest wins, ties to the least loaded, then round-robin order.
These are judgement, not measurement: they order the tiers and keep a hit of a few blocks from piling every
request onto one instance; a deployment with other costs changes them here.
"""

from __future__ import annotations

from kvplane.proxy.kv_index import CPU, DEVICE, STORE

TIER_WEIGHTS: dict[str, float] = {DEVICE: 1.0, CPU: 0.75, STORE: 0.5}
LOAD_TOKENS = 512.0


def weighted(tiers: list[str], block_size: int) -> float:
    """The weighted hit tokens of a walk's blocks (``PrefixIndex.hit``)."""
    return block_size * sum(TIER_WEIGHTS[tier] for tier in tiers)


def value(weighted_hit_tokens: float, outstanding: int) -> float:
    return weighted_hit_tokens - LOAD_TOKENS * outstanding
