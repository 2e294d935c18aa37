"""The grid NIXL's prepared lists are made over (``nixl_prep``), worked out with numpy alone: one entry per
block of a per-layer region, one per block of every layer in a cross-layer one, runs as consecutive entries,
and a finer grid where a plan needs one. No engine runs here."""

from __future__ import annotations

import numpy as np

from kvplane.transports.nixl_prep import fit_grids

KiB = 1 << 10
BLOCK, NB, LAYERS = 64 * KiB, 10, 3
LOCAL, REMOTE = 1 << 30, 1 << 34  # base addresses of the two sides' caches


def per_layer_spans(base: int) -> list[tuple[int, int]]:
    return [(base + layer * (NB * BLOCK + 4 * KiB), NB * BLOCK) for layer in range(LAYERS)]  # a gap between layers


def per_layer_plan(l_ids: list[int], r_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spans_l, spans_r = per_layer_spans(LOCAL), per_layer_spans(REMOTE)
    local = np.array([a + b * BLOCK for a, _ in spans_l for b in l_ids], dtype=np.int64)
    remote = np.array([a + b * BLOCK for a, _ in spans_r for b in r_ids], dtype=np.int64)
    return local, remote, np.full(local.size, BLOCK, dtype=np.int64)


def test_a_per_layer_cache_gets_one_entry_per_block_of_each_layer() -> None:
    local, remote, lengths = per_layer_plan([3, 7], [1, 9])
    grids = fit_grids((local, remote), lengths, (per_layer_spans(LOCAL), per_layer_spans(REMOTE)), None)
    assert grids is not None
    assert [g.unit for g in grids] == [BLOCK, BLOCK] and [g.entries for g in grids] == [LAYERS * NB] * 2
    first = grids[0].first_entries(local, lengths)
    assert first is not None and first.tolist() == [3, 7, 13, 17, 23, 27]  # layer * NB + block
    rows = grids[1].rows(0)
    assert rows.shape == (LAYERS, 5) and rows[:, 3].tolist() == [BLOCK] * LAYERS and rows[:, 4].tolist() == [NB] * 3


def test_a_cross_layer_cache_gets_one_entry_per_block_of_every_layer() -> None:
    stride = LAYERS * BLOCK  # block i of every layer is one range
    spans = [(LOCAL, NB * stride)], [(REMOTE, NB * stride)]
    local = np.array([LOCAL + b * stride for b in (2, 5)], dtype=np.int64)
    remote = np.array([REMOTE + b * stride for b in (0, 8)], dtype=np.int64)
    grids = fit_grids((local, remote), np.full(2, stride, dtype=np.int64), spans, None)
    assert grids is not None and grids[0].unit == stride and grids[0].entries == NB


def test_a_run_of_blocks_is_consecutive_entries_and_a_sub_block_plan_makes_a_finer_grid() -> None:
    local, remote, lengths = per_layer_plan([3], [1])
    spans = (per_layer_spans(LOCAL), per_layer_spans(REMOTE))
    grids = fit_grids((local, remote), lengths, spans, None)
    assert grids is not None
    run = grids[0].first_entries(local[:1], np.array([3 * BLOCK], dtype=np.int64))
    assert run is not None and run.tolist() == [3]  # entries 3, 4, 5 follow from the length
    half = np.array([BLOCK // 2], dtype=np.int64)
    assert grids[0].first_entries(local[:1] + BLOCK // 2, half) is None  # off this grid
    finer = fit_grids((local[:1] + BLOCK // 2, remote[:1]), half, spans, grids)
    assert finer is not None and finer[0].unit == BLOCK // 2 and finer[0].entries == 2 * LAYERS * NB


def test_a_descriptor_outside_every_span_has_no_grid() -> None:
    local, remote, lengths = per_layer_plan([3], [1])
    local[0] = LOCAL - BLOCK
    assert fit_grids((local, remote), lengths, (per_layer_spans(LOCAL), per_layer_spans(REMOTE)), None) is None
