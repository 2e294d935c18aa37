"""Chunked staging as a specification: cutting a staged pull into chunks of at most a bound stages every source
block exactly once, keeps each chunk within the bound, and re-laying the chunks out one after another through
one small range leaves the destination exactly as re-laying out the whole request would."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from kvref import split_choice
from test_planner import HEADS, Rank, ids_for

from kvplane.backend import get_backend
from kvplane.flows.disagg.decode.staging_chunks import block_unit, chunk_bound, split_staged
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.staging import StagingArena
from kvplane.kv.layouts import get_layout
from kvplane.plan.heads import source_ranks
from kvplane.plan.planner import StagedLayer, plan_transfer
from kvplane.plan.relayout import apply_relayout

cpu = get_backend("cpu")
WHOLE = (0, 1 << 62)


def staged_layers(src: Rank, dst: Rank, s_ids: np.ndarray, d_ids: np.ndarray, n: int) -> tuple[StagedLayer, ...]:
    tp = plan_transfer(src.manifest, dst.manifest, {0: s_ids}, {0: d_ids}, {0: n}, staging=WHOLE)
    assert tp.staged  # these cases must stage
    return tp.staged


def pull_in_chunks(src: Rank, dst: Rank, s_ids: np.ndarray, d_ids: np.ndarray, n: int, bound: int) -> int:
    """Run the direct part, then every chunk through one range of ``bound`` bytes; returns the chunk count."""
    staged = staged_layers(src, dst, s_ids, d_ids, n)
    names = {x.layer_name for x in staged}
    rest = [name for name in dst.spec.layer_names if name not in names]
    if rest:
        cpu.execute(plan_transfer(src.manifest, dst.manifest, {0: s_ids}, {0: d_ids}, {0: n}, layers=rest).plan)
    area = torch.zeros(bound, dtype=torch.uint8)
    chunks = split_staged(0, staged, {x.layer_name: s_ids for x in staged}, bound)
    for chunk in chunks:
        assert chunk.nbytes <= bound
        area.fill_(0xAB)  # what the last chunk left must not matter
        cpu.execute(chunk.plan_at(area.data_ptr()))
        for piece in chunk.staged:
            layout = get_layout(split_choice(dst.layout)[0])
            apply_relayout(piece, area, dst.spec.layer(piece.layer_name), layout, dst.cache[piece.layer_name])
    return len(chunks)


STAGED_PAIRS = [("mla", "mla_fused", "mla_split"), ("mla", "mla_split", "mla_fused"),
                ("gqa", "packed_kv", "packed_kv@HND"), ("gqa", "packed_kv", "split_kv")]


@pytest.mark.parametrize("n", [1, 37, 100])
@pytest.mark.parametrize("src_block,dst_block", [(16, 16), (16, 32), (32, 16), (8, 12)])
@pytest.mark.parametrize("family,src_layout,dst_layout", STAGED_PAIRS)
@pytest.mark.parametrize("units", [1, 2, 3, 5])
def test_chunks_stage_each_source_block_once_within_the_bound_and_land_the_request_exactly(
    family: str, src_layout: str, dst_layout: str, src_block: int, dst_block: int, n: int, units: int
) -> None:
    src = Rank(family, src_layout, 1, 0, src_block, 16, seed=1)
    dst = Rank(family, dst_layout, 1, 0, dst_block, 16, seed=2)
    s_ids, d_ids = ids_for(n, src_block, 16, 3), ids_for(n, dst_block, 16, 4)
    staged = staged_layers(src, dst, s_ids, d_ids, n)
    bound = units * max(block_unit(x) for x in staged) + 40  # not a multiple of a block: room is left over
    chunks = split_staged(0, staged, {x.layer_name: s_ids for x in staged}, bound)

    want: Counter[tuple[int, int]] = Counter()  # (source address, bytes) of every whole source block the request stages
    for x in staged:
        for part in x.sources:
            want.update(zip(part.region.block_addrs(s_ids[: part.num_blocks]).tolist(),
                            [part.region.block_bytes] * part.num_blocks, strict=True))
    got: Counter[tuple[int, int]] = Counter()
    for chunk in chunks:
        assert chunk.nbytes <= bound
        got.update(zip(chunk.src.tolist(), chunk.length.tolist(), strict=True))
        ends = chunk.offset + chunk.length  # the chunk's descriptors tile its range without overlap
        order = np.argsort(chunk.offset)
        assert chunk.offset[order][0] == 0 and np.array_equal(chunk.offset[order][1:], ends[order][:-1])
    assert got == want

    for x in staged:  # each layer's pieces cover its tokens once, in order
        pieces = [p for c in chunks for p in c.staged if p.layer_name == x.layer_name]
        starts = [(len(x.dst_block_ids) - len(p.dst_block_ids)) * dst_block + p.dst_token_start for p in pieces]
        assert starts[0] == 0 and sum(p.num_tokens for p in pieces) == n
        assert all(a + p.num_tokens == b for a, p, b in zip(starts, pieces, starts[1:], strict=False))

    assert pull_in_chunks(src, dst, s_ids, d_ids, n, bound) == len(chunks)
    for name in dst.spec.layer_names:
        want_tokens, got_tokens = src.tokens(name, s_ids, n), dst.tokens(name, d_ids, n)
        for slot in want_tokens:
            torch.testing.assert_close(got_tokens[slot], want_tokens[slot], rtol=0, atol=0)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_chunked_heterogeneous_tp_fills_each_destination_rank_with_its_heads(src_tp: int, dst_tp: int) -> None:
    n, block = 70, 16
    srcs = [Rank("gqa", "packed_kv", src_tp, r, block, 8, seed=10 + r) for r in range(src_tp)]
    s_ids = ids_for(n, block, 8, 5)
    for d in range(dst_tp):
        dst = Rank("gqa", "packed_kv", dst_tp, d, block, 8, seed=20 + d)
        d_ids = ids_for(n, block, 8, 6 + d)
        for r in source_ranks(d, dst_tp, src_tp, HEADS, False, "req"):
            unit = max(block_unit(x) for x in staged_layers(srcs[r], dst, s_ids, d_ids, n))
            assert pull_in_chunks(srcs[r], dst, s_ids, d_ids, n, 2 * unit) > 2
        per = HEADS // dst_tp
        for name in dst.spec.layer_names:
            got = dst.tokens(name, d_ids, n)
            for slot in ("k", "v"):
                full = torch.cat([s.tokens(name, s_ids, n)[slot] for s in srcs], dim=1)
                torch.testing.assert_close(got[slot], full[:, d * per : (d + 1) * per], rtol=0, atol=0)


def test_the_bound_is_half_the_staging_when_that_holds_a_block_and_staging_under_one_block_is_refused() -> None:
    src, dst = Rank("mla", "mla_fused", 1, 0, 16, 8, seed=1), Rank("mla", "mla_split", 1, 0, 16, 8, seed=2)
    ids = ids_for(40, 16, 8, 3)
    staged = staged_layers(src, dst, ids, ids, 40)
    unit = block_unit(staged[0])
    assert unit == 16 * (16 + 4) * 4  # one block of kv_c + k_pe, float32
    assert chunk_bound(8 * unit, staged) == (4 * unit // 64 * 64, 2)  # READ one half while the other re-lays out
    assert chunk_bound(unit + 10, staged) == (unit + 10, 1)  # half holds no block: one chunk at a time
    with pytest.raises(DisaggError, match=rf"DisaggConfig.staging_bytes={unit - 1} .* at least {unit}$"):
        chunk_bound(unit - 1, staged)


def test_the_arena_lends_its_unaligned_tail_whole() -> None:
    arena = StagingArena(1000)
    assert arena.take(1000) == 0  # 1000 is not a multiple of 64, and still the whole buffer
    arena.give(0)
    assert arena.take(900) == 0 and arena.take(40) == 960  # ranges start 64 B aligned; the 40 B tail is lent
    assert arena.in_use == 1000 and arena.take(1) is None
