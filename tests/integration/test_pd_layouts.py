"""Planner + real transport across two processes: every pair of layouts, TP 1->2 and 2->1, block sizes 16<->32.

A peer process holds the source ranks' caches (seeded patterns) and serves them through Mooncake TE or NIXL on
127.0.0.1. This process plans, READs (or WRITEs), re-lays out what was staged, and compares bytes with a reference
read by plain torch indexing of a locally regenerated copy of the source.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kvref import canonical, split_choice

from kvplane.backend import get_backend
from kvplane.bench.peer import CacheConfig, KVBuffer, PeerConfig, PeerProcess
from kvplane.kv.layouts import get_layout
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan.heads import source_ranks
from kvplane.plan.planner import plan_transfer
from kvplane.plan.relayout import apply_relayout
from kvplane.transports.base import Transport, TransportConfig
from kvplane.transports.registry import get_transport_class

pytestmark = pytest.mark.integration
HEADS, DIM, LAYERS, NUM_BLOCKS, TOKENS = 4, 8, 2, 16, 45
cpu = get_backend("cpu")


def spec_for(family: str, tp: int, block: int) -> KVSpec:
    if family == "gqa":
        return KVSpec.gqa(LAYERS, HEADS // tp, DIM, tokens_per_block=block, dtype="float32")
    return KVSpec.mla(LAYERS, kv_lora_rank=16, rope_dim=4, tokens_per_block=block, dtype="float32")


@dataclass(frozen=True)
class Side:
    family: str
    layout: str
    block: int = 16
    tp: int = 1
    rank: int = 0

    @property
    def name(self) -> str:
        return split_choice(self.layout)[0]

    @property
    def order(self) -> str:
        return split_choice(self.layout)[1]

    def config(self, seed: int) -> CacheConfig:
        spec = spec_for(self.family, self.tp, self.block)
        return CacheConfig(spec, self.name, NUM_BLOCKS, seed, self.rank, self.tp, "prefill", self.order)


GQA, MLA = ("packed_kv", "packed_kv@HND", "kv_first", "split_kv"), ("mla_fused", "mla_split")
SOURCES = (
    [Side("gqa", a) for a in GQA]
    + [Side("mla", a) for a in MLA]
    + [Side("gqa", "split_kv", 32), Side("gqa", "packed_kv@HND", 32)]
    + [Side("gqa", a, 16, 2, r) for a in ("packed_kv", "packed_kv@HND") for r in (0, 1)]
)
SEED = {side: 100 + i for i, side in enumerate(SOURCES)}


class Arena:
    """One registered host buffer; caches and staging areas are carved from it, so it is registered once."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = cpu.alloc_host(nbytes)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        start = -(-self.used // 64) * 64
        self.used = start + n
        if self.used > self.buffer.numel():
            raise MemoryError("test arena exhausted; make it larger")
        return self.buffer[start : start + n]


@dataclass
class Rig:
    peer: PeerProcess
    transport: Transport
    handle: str
    arena: Arena

    def source(self, side: Side) -> Manifest:
        return self.peer.manifests[SOURCES.index(side)]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    engine = request.param
    peer = PeerProcess(PeerConfig(tuple(side.config(SEED[side]) for side in SOURCES), engine))
    arena = Arena(64 << 20)
    transport = get_transport_class(engine)(
        cpu, TransportConfig(timeout_s=30.0), agent_name=f"decode-{engine}"
    )
    transport.register([(arena.buffer.data_ptr(), arena.buffer.numel())])
    try:
        yield Rig(peer, transport, transport.connect(peer.info), arena)
    finally:
        transport.close()
        peer.close()


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit equality: the seeded patterns are not meaningful floats (some are NaN)."""
    assert got.shape == want.shape
    g, w = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    mismatched = int((g != w).sum())
    assert mismatched == 0, f"{mismatched} of {g.numel()} elements differ"


def regenerate(side: Side) -> KVBuffer:
    """The source rank's cache, rebuilt here from its seed: the reference the transfer must reproduce."""
    kv = KVBuffer(spec_for(side.family, side.tp, side.block), side.name, NUM_BLOCKS, cpu.alloc_host, side.order)
    kv.fill(SEED[side])
    return kv


def read_into(
    rig: Rig, src: Side, dst_kv: KVBuffer, dst_manifest: Manifest, src_ids: np.ndarray, dst_ids: np.ndarray
) -> None:
    src_manifest = rig.source(src)
    args = (src_manifest, dst_manifest, {0: src_ids}, {0: dst_ids}, {0: TOKENS})
    staging = rig.arena.take(max(plan_transfer(*args, staging=(0, 1 << 62)).staging_bytes, 64))
    tp = plan_transfer(*args, staging=(staging.data_ptr(), staging.numel()))
    rig.transport.transfer(rig.handle, "READ", tp.plan)
    for staged in tp.staged:
        layer = dst_kv.spec.layer(staged.layer_name)
        apply_relayout(staged, staging, layer, get_layout(str(dst_kv.layout)), dst_kv.cache[staged.layer_name])


def ids(block: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(NUM_BLOCKS, -(-TOKENS // block), replace=False).astype(np.int64)


PAIRS = (
    [(Side("gqa", a), Side("gqa", b)) for a in GQA for b in GQA]
    + [(Side("mla", a), Side("mla", b)) for a in MLA for b in MLA]
    + [
        (Side("gqa", "split_kv", 16), Side("gqa", "split_kv", 32)),
        (Side("gqa", "split_kv", 32), Side("gqa", "split_kv", 16)),
    ]
    + [
        (Side("gqa", "packed_kv@HND", 16), Side("gqa", "packed_kv@HND", 32)),
        (Side("gqa", "packed_kv@HND", 32), Side("gqa", "packed_kv", 16)),
    ]
)


@pytest.mark.parametrize(
    "src,dst", PAIRS, ids=[f"{s.layout}{s.block}-to-{d.layout}{d.block}" for s, d in PAIRS]
)
def test_read_lands_every_token_for_each_layout_and_block_size_pair(rig: Rig, src: Side, dst: Side) -> None:
    dst_kv = KVBuffer(spec_for(dst.family, dst.tp, dst.block), dst.name, NUM_BLOCKS, rig.arena.take, dst.order)
    dst_kv.fill(999)
    src_ids, dst_ids = ids(src.block, 1), ids(dst.block, 2)
    read_into(rig, src, dst_kv, dst_kv.manifest("decode", 0, 1, "cpu"), src_ids, dst_ids)
    ref = regenerate(src)
    for layer in dst_kv.spec.layers:
        want = canonical(src.layout, ref.cache[layer.name], src_ids, TOKENS, ref.spec.layer(layer.name))
        got = canonical(dst.layout, dst_kv.cache[layer.name], dst_ids, TOKENS, layer)
        for slot in want:
            assert_same_bits(got[slot], want[slot])


@pytest.mark.parametrize("layout", ["packed_kv@HND", "packed_kv"])  # head-major moves directly, token-major is staged
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1)])
def test_heterogeneous_tp_read_gives_each_decode_rank_its_heads(
    rig: Rig, layout: str, src_tp: int, dst_tp: int
) -> None:
    sources = [
        Side("gqa", layout, 16, src_tp, r) if src_tp > 1 else Side("gqa", layout) for r in range(src_tp)
    ]
    src_ids = ids(16, 3)
    refs = [regenerate(s) for s in sources]
    for d in range(dst_tp):
        dst_kv = KVBuffer(spec_for("gqa", dst_tp, 16), *split_choice(layout)[:1], NUM_BLOCKS, rig.arena.take,
                          split_choice(layout)[1])
        dst_kv.fill(500 + d)
        manifest = dst_kv.manifest("decode", d, dst_tp, "cpu")
        dst_ids = ids(16, 4 + d)
        for r in source_ranks(d, dst_tp, src_tp, HEADS, False, "req-1"):
            read_into(rig, sources[r], dst_kv, manifest, src_ids, dst_ids)
        per = HEADS // dst_tp
        for layer in dst_kv.spec.layers:
            got = canonical(layout, dst_kv.cache[layer.name], dst_ids, TOKENS, layer)
            for slot in ("k", "v"):
                full = torch.cat(
                    [
                        canonical(layout, ref.cache[layer.name], src_ids, TOKENS, ref.spec.layer(layer.name))[
                            slot
                        ]
                        for ref in refs
                    ],
                    dim=1,
                )
                assert_same_bits(got[slot], full[:, d * per : (d + 1) * per])


@pytest.mark.parametrize(
    "src,dst",
    [
        (Side("gqa", "split_kv", 16), Side("gqa", "split_kv", 32)),
        (Side("mla", "mla_fused"), Side("mla", "mla_fused")),
    ],
)
def test_write_into_the_peer_matches_the_same_plan_run_locally(rig: Rig, src: Side, dst: Side) -> None:
    local = KVBuffer(spec_for(src.family, src.tp, src.block), src.name, NUM_BLOCKS, rig.arena.take, src.order)
    local.fill(777)
    local_manifest = local.manifest("prefill", 0, 1, "cpu")
    peer_side = next(
        s
        for s in SOURCES
        if s.family == dst.family and s.layout == dst.layout and s.block == dst.block and s.tp == 1
    )
    local_ids, peer_ids = ids(src.block, 5), ids(dst.block, 6)
    tp = plan_transfer(local_manifest, rig.source(peer_side), {0: local_ids}, {0: peer_ids}, {0: TOKENS})
    assert not tp.staged
    rig.transport.transfer(rig.handle, "WRITE", tp.plan)
    mirror = regenerate(peer_side)  # what the peer held, then the same plan applied here
    mirror_plan = plan_transfer(
        local_manifest, mirror.manifest("prefill", 0, 1, "cpu"), {0: local_ids}, {0: peer_ids}, {0: TOKENS}
    )
    cpu.execute(mirror_plan.plan)
    index = SOURCES.index(peer_side)
    every_block = list(range(NUM_BLOCKS))
    assert rig.peer.call("digest", cache=index, block_ids=every_block) == mirror.digest(np.arange(NUM_BLOCKS))
