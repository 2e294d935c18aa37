"""NIXL's prepared descriptor lists with two real agents on 127.0.0.1: plans from kvplane's planner over vLLM's
per-layer and cross-layer caches move through ``make_prepped_xfer`` (pull and push), byte for byte; a plan that
does not map (a grid over ``MAX_ENTRIES``) goes the unprepared way and is counted; a reset, or a peer that
connects again, gets fresh lists.

Both agents live in this process, so each descriptor's source and destination bytes are compared directly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.bench.peer import KVBuffer
from kvplane.descriptors import CopyPlan
from kvplane.kv.spec import KVSpec
from kvplane.plan.planner import plan_transfer
from kvplane.transports import nixl_prep
from kvplane.transports.base import Op, TransportConfig
from kvplane.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration
HEADS, DIM, LAYERS, NUM_BLOCKS, BLOCK = 4, 8, 3, 24, 16
cpu = get_backend("cpu")


def spec(tp: int = 1) -> KVSpec:
    return KVSpec.gqa(LAYERS, HEADS // tp, DIM, tokens_per_block=BLOCK, dtype="float32")


@dataclass
class Pair:
    """Two NIXL transports in this process, ``a`` connected to ``b``, each over one KV cache."""

    a: NixlTransport
    b: NixlTransport
    a_kv: KVBuffer
    b_kv: KVBuffer
    handle: str

    def close(self) -> None:
        self.a.close()
        self.b.close()


def make_pair(a_kv: KVBuffer, b_kv: KVBuffer) -> Pair:
    ok, why = NixlTransport.available()
    if not ok:
        pytest.skip(f"nixl is not usable here: {why}")
    a = NixlTransport(cpu, TransportConfig(timeout_s=30.0))
    b = NixlTransport(cpu, TransportConfig(timeout_s=30.0))
    a.register(cpu.registration_spans(a_kv.regions))
    b.register(cpu.registration_spans(b_kv.regions))
    return Pair(a, b, a_kv, b_kv, a.connect(b.peer_info()))


@pytest.fixture(params=[False, True], ids=["per-layer", "cross-layer"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    layout = "packed_kv"
    a_kv = KVBuffer(spec(), layout, NUM_BLOCKS, cpu.alloc_host, cross_layer=request.param)
    b_kv = KVBuffer(spec(), layout, NUM_BLOCKS, cpu.alloc_host, cross_layer=request.param)
    p = make_pair(a_kv, b_kv)
    yield p
    p.close()


def ids(seed: int, n: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).choice(NUM_BLOCKS, n, replace=False).astype(np.int64)


def plan_for(p: Pair, op: Op, a_ids: np.ndarray, b_ids: np.ndarray) -> CopyPlan:
    ma, mb = p.a_kv.manifest("a", 0, 1, "cpu"), p.b_kv.manifest("b", 0, 1, "cpu")
    tokens = {0: a_ids.size * BLOCK}
    if op == "READ":  # from b into a
        return plan_transfer(mb, ma, {0: b_ids}, {0: a_ids}, tokens).plan
    return plan_transfer(ma, mb, {0: a_ids}, {0: b_ids}, tokens).plan


def assert_moved(plan: CopyPlan) -> None:
    """Every descriptor's destination holds its source's bytes (both sides are this process's memory)."""
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        assert ctypes.string_at(d, n) == ctypes.string_at(s, n), f"descriptor {s:#x} -> {d:#x} ({n} B) differs"


def move(p: Pair, op: Op, plan: CopyPlan, seed: int) -> None:
    p.a_kv.fill(seed)
    p.b_kv.fill(seed + 1)
    p.a.transfer(p.handle, op, plan)
    assert_moved(plan)


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_plans_move_through_lists_prepared_once_per_peer(pair: Pair, op: Op) -> None:
    first, second = plan_for(pair, op, ids(1), ids(2)), plan_for(pair, op, ids(3), ids(4))
    move(pair, op, first, 10)
    move(pair, op, second, 20)
    stats = pair.a.prep_stats
    assert (stats.prepped, stats.unprepped, stats.preps) == (2, 0, 1)


def test_consecutive_blocks_coalesced_by_the_planner_still_map_onto_the_prepared_entries(pair: Pair) -> None:
    move(pair, "READ", plan_for(pair, "READ", ids(1), ids(2)), 10)
    runs = plan_for(pair, "READ", np.arange(2, 12), np.arange(5, 15))
    assert len(runs) < 10 * (1 if pair.a_kv.cross_layer else LAYERS)  # the planner merged the runs
    move(pair, "READ", runs, 30)
    assert (pair.a.prep_stats.prepped, pair.a.prep_stats.preps) == (2, 1)


def test_with_prepping_off_the_same_plan_moves_unprepared(pair: Pair) -> None:
    pair.a.use_prepped = False
    move(pair, "WRITE", plan_for(pair, "WRITE", ids(5), ids(6)), 40)
    assert (pair.a.prep_stats.prepped, pair.a.prep_stats.unprepped) == (0, 1)
    assert pair.a.prep_stats.reasons == {"disabled": 1}


def test_a_reset_drops_the_prepared_lists_and_the_next_plan_gets_fresh_ones(pair: Pair) -> None:
    plan = plan_for(pair, "READ", ids(7), ids(8))
    move(pair, "READ", plan, 50)
    pair.a.reset()
    assert pair.a._prep.peers() == []  # released before the old agent went
    move(pair, "READ", plan, 60)
    assert (pair.a.prep_stats.prepped, pair.a.prep_stats.preps) == (2, 2)


def test_a_peer_that_connects_again_gets_fresh_lists(pair: Pair) -> None:
    plan = plan_for(pair, "WRITE", ids(9), ids(10))
    move(pair, "WRITE", plan, 70)
    pair.b.reset()  # the peer restarted: new metadata, a new handshake
    handle = pair.a.connect(pair.b.peer_info())
    assert handle == pair.handle
    move(pair, "WRITE", plan, 80)
    assert (pair.a.prep_stats.prepped, pair.a.prep_stats.preps) == (2, 2)


@pytest.fixture
def hetero_tp() -> Iterator[Pair]:
    """Decode rank 0 of TP 2 (``a``) reading from a TP 1 prefill (``b``), head-major: head slices of blocks."""
    a_kv = KVBuffer(spec(2), "packed_kv", NUM_BLOCKS, cpu.alloc_host, "HND")
    b_kv = KVBuffer(spec(1), "packed_kv", NUM_BLOCKS, cpu.alloc_host, "HND")
    p = make_pair(a_kv, b_kv)
    yield p
    p.close()


def hetero_plan(p: Pair, a_ids: np.ndarray, b_ids: np.ndarray) -> CopyPlan:
    ma, mb = p.a_kv.manifest("a", 0, 2, "cpu"), p.b_kv.manifest("b", 0, 1, "cpu")
    tp = plan_transfer(mb, ma, {0: b_ids}, {0: a_ids}, {0: a_ids.size * BLOCK})
    assert not tp.staged
    return tp.plan


def test_heterogeneous_tp_head_slices_move_prepared(hetero_tp: Pair) -> None:
    plan = hetero_plan(hetero_tp, ids(3), ids(4))
    assert int(plan.length.max()) < hetero_tp.b_kv.regions[0].block_bytes  # sub-block ranges on the source
    move(hetero_tp, "READ", plan, 90)
    stats = hetero_tp.a.prep_stats
    assert (stats.prepped, stats.unprepped, stats.preps) == (1, 0, 1)


def halves(plan: CopyPlan) -> CopyPlan:
    """Each descriptor as two of half its length (sub-block ranges)."""
    half = plan.length // 2
    return CopyPlan(np.stack([plan.src, plan.src + half], 1).ravel(), np.stack([plan.dst, plan.dst + half], 1).ravel(),
                    np.stack([half, plan.length - half], 1).ravel())


def test_a_plan_off_the_grid_makes_a_finer_one_that_later_whole_blocks_still_use(pair: Pair) -> None:
    move(pair, "READ", plan_for(pair, "READ", ids(1), ids(2)), 10)
    move(pair, "READ", halves(plan_for(pair, "READ", ids(3), ids(4))), 20)
    move(pair, "READ", plan_for(pair, "READ", ids(5), ids(6)), 30)
    assert (pair.a.prep_stats.prepped, pair.a.prep_stats.unprepped, pair.a.prep_stats.preps) == (3, 0, 2)


def test_a_plan_whose_grid_would_be_too_fine_moves_unprepared_and_is_counted(
    hetero_tp: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl_prep, "MAX_ENTRIES", 64)
    move(hetero_tp, "READ", hetero_plan(hetero_tp, ids(5), ids(6)), 100)
    stats = hetero_tp.a.prep_stats
    assert (stats.prepped, stats.unprepped, stats.preps) == (0, 1, 0)
    assert list(stats.reasons) == [next(iter(stats.reasons))] and "MAX_ENTRIES" in next(iter(stats.reasons))
