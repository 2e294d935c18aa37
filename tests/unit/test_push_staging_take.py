"""A push takes its staging room for every prefill rank at once (``Starter._take_staging``): all of it or none.

The summed need of the ranks is checked against ``DisaggConfig.staging_bytes`` before anything is taken, so a
push that could never fit is refused at once (not left waiting for room until ``push_timeout_s``), and a refusal
leaves no range behind for the ranks sized before it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvplane.flows.disagg.decode import decode_start
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.staging import StagingArena


def _starter(arena: StagingArena) -> decode_start.Starter:
    starter = decode_start.Starter.__new__(decode_start.Starter)  # only the kit's arena and manifest are read
    starter.kit = SimpleNamespace(local=SimpleNamespace(arena=arena, manifest=None))  # type: ignore[assignment]
    return starter


def _want(ranks: int) -> Any:
    conns = [SimpleNamespace(rank=r, record=SimpleNamespace(manifest=None), stages={}) for r in range(ranks)]
    return SimpleNamespace(conns=conns, num_tokens=64, block_ids={0: []}, request_id="r", planned=None, first={})


@pytest.fixture
def needs(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Bytes each prefill rank must stage, by rank (its stand-in source ids carry the rank here)."""
    by_rank: dict[int, int] = {}
    monkeypatch.setattr(decode_start, "_stand_in_ids", lambda conn, n: conn.rank)
    monkeypatch.setattr(decode_start, "route_plan", lambda src, dst, rank, *_: SimpleNamespace(staging_bytes=by_rank[rank]))
    return by_rank


def test_ranks_that_fit_one_by_one_but_not_together_are_refused_at_once_taking_nothing(needs: dict[int, int]) -> None:
    needs.update({0: 640, 1: 640})
    arena = StagingArena(1024)
    with pytest.raises(DisaggError, match=r"1280 B.*staging_bytes=1024"):
        _starter(arena)._take_staging(_want(2), {0: ["l0"], 1: ["l0"]})
    assert arena.take(1024) == 0  # nothing was left taken


def test_a_rank_too_big_for_the_buffer_leaves_nothing_taken_for_the_ranks_before_it(needs: dict[int, int]) -> None:
    needs.update({0: 128, 1: 4096})
    arena = StagingArena(1024)
    with pytest.raises(DisaggError, match="staging_bytes=1024"):
        _starter(arena)._take_staging(_want(2), {0: ["l0"], 1: ["l0"]})
    assert arena.take(1024) == 0


def test_ranks_that_fit_together_each_get_their_own_range(needs: dict[int, int]) -> None:
    needs.update({0: 256, 1: 512})
    arena = StagingArena(1024)
    got = _starter(arena)._take_staging(_want(2), {0: ["l0"], 1: ["l0"]})
    assert got is not None and {r: n for r, (_, n, _) in got.items()} == {0: 256, 1: 512}
    (a, na), (b, nb) = sorted((offset, n) for offset, n, _ in got.values())
    assert a + na <= b  # the ranges do not overlap


def test_no_room_for_now_gives_back_what_was_taken(needs: dict[int, int]) -> None:
    needs.update({0: 256, 1: 512})
    arena = StagingArena(1024)
    held = arena.take(512)  # another request holds half
    assert held is not None
    assert _starter(arena)._take_staging(_want(2), {0: ["l0"], 1: ["l0"]}) is None
    arena.give(held)
    assert arena.take(1024) == 0
