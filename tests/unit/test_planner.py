"""The planner as a specification: for every pair of layouts, TP sizes and block sizes, executing the plan
(and the staged re-layout) leaves the destination holding exactly the request's tokens for its heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvref import canonical, split_choice

from kvplane.backend import get_backend
from kvplane.errors import PlanError
from kvplane.kv.binding import allocate_cache, regions_from_tensors
from kvplane.kv.layouts import get_layout
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan.heads import replica_rank, source_ranks
from kvplane.plan.planner import plan_transfer
from kvplane.plan.relayout import apply_relayout

HEADS, DIM, LAYERS = 4, 8, 2
cpu = get_backend("cpu")

ROOM = (0, 1 << 62)  # staging with room to spare: the plan says how much it needs (addresses unread)


class Rank:
    """One rank's cache in this process: spec, layout, tensors filled with distinct values, manifest."""

    def __init__(self, family: str, layout: str, tp: int, rank: int, block: int, num_blocks: int, seed: int,
                 groups: list[int] | None = None) -> None:
        if family == "gqa":
            self.spec = KVSpec.gqa(LAYERS if groups is None else len(groups), HEADS // tp, DIM,
                                   tokens_per_block=block, layer_groups=groups, dtype="float32")
        else:
            self.spec = KVSpec.mla(LAYERS, kv_lora_rank=16, rope_dim=4, tokens_per_block=block, dtype="float32")
        self.layout, self.tp, self.rank, self.block = layout, tp, rank, block
        name, order = split_choice(layout)
        self.cache = allocate_cache(self.spec, name, num_blocks, order=order)
        gen = torch.Generator().manual_seed(seed)
        for v in self.cache.values():
            for t in (v,) if isinstance(v, torch.Tensor) else v:
                t.copy_(torch.randn(t.shape, generator=gen))
        self.manifest = Manifest(
            engine_id=f"e{seed}", rank=rank, tp_size=tp, device_type="cpu", spec=self.spec,
            layouts={self.spec.layers[0].family: name},
            regions=tuple(regions_from_tensors(self.spec, self.cache, name)),
        )

    def tokens(self, layer: str, ids: np.ndarray, n: int) -> dict[str, torch.Tensor]:
        """Canonical ``(tokens, heads, dim)`` per spec slot, by plain indexing of the layout's tensors."""
        return canonical(self.layout, self.cache[layer], ids, n, self.spec.layer(layer))


def move(src: Rank, dst: Rank, src_ids: np.ndarray, dst_ids: np.ndarray, n: int) -> None:
    """Plan, run the descriptors with the cpu backend, then re-lay out anything staged."""
    need = plan_transfer(src.manifest, dst.manifest, {0: src_ids}, {0: dst_ids}, {0: n}, staging=ROOM).staging_bytes
    staging = torch.zeros(max(need, 1), dtype=torch.uint8)
    tp = plan_transfer(src.manifest, dst.manifest, {0: src_ids}, {0: dst_ids}, {0: n},
                       staging=(staging.data_ptr(), staging.numel()))
    cpu.execute(tp.plan)
    for staged in tp.staged:
        layer = dst.spec.layer(staged.layer_name)
        apply_relayout(staged, staging, layer, get_layout(split_choice(dst.layout)[0]), dst.cache[staged.layer_name])


def ids_for(n: int, block: int, num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(num_blocks, -(-n // block), replace=False).astype(np.int64)


GQA_LAYOUTS = ["packed_kv", "packed_kv@HND", "kv_first", "split_kv"]
MLA_LAYOUTS = ["mla_fused", "mla_split"]


@pytest.mark.parametrize("n", [1, 37, 64])
@pytest.mark.parametrize("src_block,dst_block", [(16, 16), (16, 32), (32, 16), (8, 12)])
@pytest.mark.parametrize(
    "family,src_layout,dst_layout",
    [("gqa", a, b) for a in GQA_LAYOUTS for b in GQA_LAYOUTS] + [("mla", a, b) for a in MLA_LAYOUTS for b in MLA_LAYOUTS],
)
def test_every_layout_pair_and_block_size_lands_the_request_exactly(
    family: str, src_layout: str, dst_layout: str, src_block: int, dst_block: int, n: int
) -> None:
    src = Rank(family, src_layout, 1, 0, src_block, 12, seed=1)
    dst = Rank(family, dst_layout, 1, 0, dst_block, 12, seed=2)
    s_ids, d_ids = ids_for(n, src_block, 12, 3), ids_for(n, dst_block, 12, 4)
    untouched = {name: dst.tokens(name, np.setdiff1d(np.arange(12), d_ids), 10**6)
                 for name in dst.spec.layer_names}
    move(src, dst, s_ids, d_ids, n)
    for name in dst.spec.layer_names:
        want, got = src.tokens(name, s_ids, n), dst.tokens(name, d_ids, n)
        for slot in want:
            torch.testing.assert_close(got[slot], want[slot], rtol=0, atol=0)
        after = dst.tokens(name, np.setdiff1d(np.arange(12), d_ids), 10**6)
        for slot in after:  # blocks outside the request are never written
            torch.testing.assert_close(after[slot], untouched[name][slot], rtol=0, atol=0)


@pytest.mark.parametrize("layout", GQA_LAYOUTS)
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_heterogeneous_tp_fills_each_destination_rank_with_its_heads(layout: str, src_tp: int, dst_tp: int) -> None:
    n, block = 40, 16
    srcs = [Rank("gqa", layout, src_tp, r, block, 8, seed=10 + r) for r in range(src_tp)]
    s_ids = ids_for(n, block, 8, 5)
    for d in range(dst_tp):
        dst = Rank("gqa", layout, dst_tp, d, block, 8, seed=20 + d)
        d_ids = ids_for(n, block, 8, 6 + d)
        for r in source_ranks(d, dst_tp, src_tp, HEADS, False, "req"):
            move(srcs[r], dst, s_ids, d_ids, n)
        for name in dst.spec.layer_names:
            full = {slot: torch.cat([s.tokens(name, s_ids, n)[slot] for s in srcs], dim=1) for slot in ("k", "v")}
            per = HEADS // dst_tp
            got = dst.tokens(name, d_ids, n)
            for slot in ("k", "v"):
                torch.testing.assert_close(got[slot], full[slot][:, d * per : (d + 1) * per], rtol=0, atol=0)


def test_hnd_head_slices_move_directly_but_token_major_head_slices_are_staged() -> None:
    for layout, staged in (("packed_kv@HND", False), ("packed_kv", True)):
        src, dst = Rank("gqa", layout, 1, 0, 16, 8, 1), Rank("gqa", layout, 2, 1, 16, 8, 2)
        ids = np.arange(3, dtype=np.int64)
        need = plan_transfer(src.manifest, dst.manifest, {0: ids}, {0: ids}, {0: 48}, staging=ROOM).staging_bytes
        assert (need > 0) is staged
        tp = plan_transfer(src.manifest, dst.manifest, {0: ids}, {0: ids}, {0: 48}, staging=(0, need))
        # never one descriptor per token: at most one per (block, region) plus head runs
        assert len(tp.plan) <= 3 * LAYERS * 2 * HEADS


def test_mla_is_read_from_one_replica_chosen_by_request() -> None:
    ranks = {replica_rank(f"req-{i}", 4) for i in range(64)}
    assert ranks == {0, 1, 2, 3}  # requests spread over the replicas
    assert source_ranks(1, 2, 4, 1, True, "req-7") == [replica_rank("req-7", 4)]


def test_two_kv_cache_groups_move_in_one_plan() -> None:
    src = Rank("gqa", "split_kv", 1, 0, 16, 10, 1, groups=[0, 1, 0, 1])
    dst = Rank("gqa", "split_kv", 1, 0, 16, 10, 2, groups=[0, 1, 0, 1])
    s = {0: ids_for(30, 16, 10, 1), 1: ids_for(20, 16, 10, 2)}
    d = {0: ids_for(30, 16, 10, 3), 1: ids_for(20, 16, 10, 4)}
    tp = plan_transfer(src.manifest, dst.manifest, s, d, {0: 30, 1: 20})
    cpu.execute(tp.plan)
    for layer in dst.spec.layers:
        g, n = layer.group_id, (30 if layer.group_id == 0 else 20)
        want, got = src.tokens(layer.name, s[g], n), dst.tokens(layer.name, d[g], n)
        for slot in want:
            torch.testing.assert_close(got[slot], want[slot], rtol=0, atol=0)


def test_too_few_blocks_for_the_tokens_is_an_error_not_a_partial_transfer() -> None:
    src, dst = Rank("gqa", "split_kv", 1, 0, 16, 8, 1), Rank("gqa", "split_kv", 1, 0, 16, 8, 2)
    with pytest.raises(PlanError, match="destination blocks"):
        plan_transfer(src.manifest, dst.manifest, {0: np.arange(4)}, {0: np.arange(2)}, {0: 60})


def test_a_staged_transfer_without_a_staging_buffer_names_the_bytes_it_needs() -> None:
    src, dst = Rank("mla", "mla_fused", 1, 0, 16, 8, 1), Rank("mla", "mla_split", 1, 0, 16, 8, 2)
    with pytest.raises(PlanError, match=r"must stage \d+ B"):
        plan_transfer(src.manifest, dst.manifest, {0: np.arange(2)}, {0: np.arange(2)}, {0: 20})


def test_out_of_range_block_id_is_rejected() -> None:
    src, dst = Rank("gqa", "split_kv", 1, 0, 16, 8, 1), Rank("gqa", "split_kv", 1, 0, 16, 8, 2)
    with pytest.raises(PlanError, match="out of range"):
        plan_transfer(src.manifest, dst.manifest, {0: np.array([0, 8])}, {0: np.arange(2)}, {0: 32})


@settings(max_examples=60, deadline=None, database=None)
@given(
    n=st.integers(0, 200),
    src_block=st.sampled_from([4, 8, 16, 32]),
    dst_block=st.sampled_from([4, 8, 16, 32]),
    layout=st.sampled_from(GQA_LAYOUTS),
    seed=st.integers(0, 1000),
)
def test_plans_cover_the_request_and_destination_ranges_never_overlap(
    n: int, src_block: int, dst_block: int, layout: str, seed: int
) -> None:
    nb = 64
    src = Rank("gqa", layout, 1, 0, src_block, nb, 1)
    dst = Rank("gqa", layout, 1, 0, dst_block, nb, 2)
    s_ids, d_ids = ids_for(n, src_block, nb, seed), ids_for(n, dst_block, nb, seed + 1)
    tp = plan_transfer(src.manifest, dst.manifest, {0: s_ids}, {0: d_ids}, {0: n})
    g = np.gcd(src_block, dst_block)
    bytes_per_token = src.spec.bytes_per_token
    assert tp.plan.total_bytes == -(-n // g) * g * bytes_per_token
    order = np.argsort(tp.plan.dst)
    starts, ends = tp.plan.dst[order], tp.plan.dst[order] + tp.plan.length[order]
    assert np.all(starts[1:] >= ends[:-1])


def test_sides_that_differ_only_in_memory_order_plan_a_staged_transfer_and_name_both_layouts() -> None:
    src, dst = Rank("gqa", "packed_kv", 1, 0, 16, 8, 1), Rank("gqa", "packed_kv@HND", 1, 0, 16, 8, 2)
    with pytest.raises(PlanError, match=r"source e1 rank 0 has k\+v rows of \d+ B x 4 heads, NHD.*destination e2 "
                                        r"rank 0 has k\+v rows of \d+ B x 4 heads, HND"):
        plan_transfer(src.manifest, dst.manifest, {0: np.arange(2)}, {0: np.arange(2)}, {0: 20})
    s_ids, d_ids = ids_for(40, 16, 8, 3), ids_for(40, 16, 8, 4)
    move(src, dst, s_ids, d_ids, 40)  # with a staging buffer the bytes land re-laid out
    for name in dst.spec.layer_names:
        want, got = src.tokens(name, s_ids, 40), dst.tokens(name, d_ids, 40)
        for slot in want:
            torch.testing.assert_close(got[slot], want[slot], rtol=0, atol=0)
