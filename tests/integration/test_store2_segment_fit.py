"""A store segment that cannot hold one block of each KV-cache group is an error at setup, naming the field,
its value and the fix, against a real ``mooncake_master`` (each host block is one store object: such a segment
refuses every put, and nothing ever loads from the store).

Each test here failed on main before its fix (the engine was built and every put was refused, -200).
"""

from __future__ import annotations

import pytest

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.flows.offload import (
    MooncakeMaster,
    OffloadConfig,
    OffloadConfigError,
    OffloadEngine,
    StoreConfig,
)
from kvplane.flows.offload.store import StoreTier
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

pytestmark = pytest.mark.integration
MiB = 1 << 20


def big_block_spec(groups: int) -> KVSpec:
    """Blocks of 20 MiB for one group, 10 MiB each for two (1 layer each: 2 x 8 heads x 128 x bf16 = 4 KiB a
    token): either way more than a 16 MiB segment holds."""
    tokens = 5120 // groups
    return KVSpec.gqa(groups, 8, 128, tokens_per_block=tokens, layer_groups=list(range(groups)),
                      group_tokens_per_block={g: tokens for g in range(groups)})


def engine(spec: KVSpec, store: StoreConfig | None, tier: StoreTier | None = None) -> OffloadEngine:
    backend = CpuBackend(copy_threads=1)
    cache = allocate_cache(spec, backend.layouts, 2)
    return OffloadEngine(bind(backend, spec, cache), OffloadConfig(host_bytes=20 * MiB, store=store, pinned=False),
                         store_tier=tier)


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "hybrid"])
def test_a_segment_smaller_than_one_block_of_each_group_is_refused_at_setup(
    master: MooncakeMaster, groups: int
) -> None:
    store = StoreConfig(master.address, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB, namespace="store2-fit")
    made = None
    try:
        with pytest.raises(OffloadConfigError) as raised:
            made = engine(big_block_spec(groups), store)
    finally:
        if made is not None:
            made.close()
    text = str(raised.value)
    assert f"StoreConfig.segment_bytes={16 * MiB}" in text and f"({20 * MiB} B;" in text
    assert "or 0 to use only the segments other clients lend" in text
    if groups == 2:
        assert f"group 0: {10 * MiB} B, group 1: {10 * MiB} B" in text


def test_a_tier_handed_in_is_checked_too_and_a_segment_of_zero_is_not(master: MooncakeMaster) -> None:
    tier = StoreTier(StoreConfig(master.address, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB,
                                 namespace="store2-fit-given"))
    try:
        with pytest.raises(OffloadConfigError, match="StoreConfig.segment_bytes=16777216 cannot hold"):
            engine(big_block_spec(1), None, tier)
    finally:
        tier.close()
    zero = engine(big_block_spec(1), StoreConfig(master.address, segment_bytes=0, local_buffer_bytes=16 * MiB,
                                                 namespace="store2-fit-zero"))
    try:
        assert zero.store is not None  # lends nothing: other clients' segments hold its blocks
    finally:
        zero.close()
