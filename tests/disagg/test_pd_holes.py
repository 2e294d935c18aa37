"""Holes (``HOLE``, vLLM's null block: a position without a block) in a P/D transfer. A position where only the
prefill has a hole and the decode has a real block cannot be filled: moving nothing would leave that decode block
with stale KV that the engine then reads as the prompt's. Inside the transfer window it is refused, naming the
group, the position and the fix; the request fails, no block leaks on either side, and the next request works.
A hole on both sides (out of a sliding window on both) and a hole on the decode side only move nothing for it.
Real sides on 127.0.0.1, both engines (the planner is shared: the decode plans a pull, the prefill a push)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvfill import digest
from pair import Engine, make, push_params, small_spec, token_for

from kvplane.blocks.groups import HOLE

pytestmark = pytest.mark.integration
BLOCK, TOKENS = 16, 48  # three whole blocks


@pytest.fixture(params=["mooncake", "nixl"])
def sides(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    spec = small_spec()
    prefill = make("prefill", spec, seed=3, engine=request.param)
    decode = make("decode", spec, engine=request.param)
    yield prefill, decode
    decode.close()
    prefill.close()


def _with_hole(ids: list[int], at: int) -> list[int]:
    return [HOLE if i == at else b for i, b in enumerate(ids)]


def _block(engine: Engine, block: int) -> str:
    """A digest of one block's KV in every layer."""
    return digest(engine.spec, engine.cache, engine.layout, {0: [block]}, BLOCK)


def _assert_next_pull_works(prefill: Engine, decode: Engine, rid: str) -> None:
    src = prefill.allocate(TOKENS)
    params = prefill.side.request_finished(rid, src, TOKENS)
    dst = decode.allocate(TOKENS)
    decode.side.start_pull(rid, params, dst)
    assert decode.wait(rid).state == "done"
    assert prefill.wait(rid).state == "done"
    for s, d in zip(src, dst):
        assert _block(prefill, s) == _block(decode, d)
    prefill.pool.free(src)
    decode.pool.free(dst)


@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_pull_where_only_the_prefill_has_a_hole_is_refused_naming_group_position_and_fix(
    sides: tuple[Engine, Engine], at: int
) -> None:
    prefill, decode = sides
    src = prefill.allocate(TOKENS)
    params = prefill.side.request_finished("holed", _with_hole(src, at), TOKENS)
    dst = decode.allocate(TOKENS)
    before = _block(decode, dst[at])
    decode.side.start_pull("holed", params, dst)
    done = decode.wait("holed")
    assert done.state == "failed", done  # on main: "done", with decode block dst[at] keeping what it held
    assert "group 0" in done.reason and f"block position {at}" in done.reason and "HOLE" in done.reason, done.reason
    assert "null block" in done.reason, done.reason  # the fix: a hole on the decode side too
    assert _block(decode, dst[at]) == before
    assert done.all_failed_block_ids() == set(dst)
    assert prefill.wait("holed").state == "failed"  # its ReadDone(ok=False) freed it, no lease wait
    assert prefill.side.held_requests() == 0 and decode.side.pending_requests() == 0
    assert decode.side.local.arena.in_use == 0
    prefill.pool.free(src)
    decode.pool.free(dst)
    assert prefill.whole and decode.whole
    _assert_next_pull_works(prefill, decode, "after")


def test_a_push_where_only_the_prefill_has_a_hole_is_refused_and_the_next_request_works(
    sides: tuple[Engine, Engine]
) -> None:
    prefill, decode = sides
    params = push_params(prefill.side.base_port, "holed", prefill.side.config.engine_id)
    dst = decode.allocate(TOKENS)
    decode.side.register_push("holed", params, dst, TOKENS)
    src = prefill.allocate(TOKENS)
    prefill.side.request_finished("holed", _with_hole(src, 1), TOKENS, token=token_for("holed"))
    done = decode.wait("holed")
    assert done.state == "failed", done
    assert "group 0" in done.reason and "block position 1" in done.reason, done.reason
    assert prefill.wait("holed").state == "failed"
    assert prefill.side.held_requests() == 0 and decode.side.pending_requests() == 0
    prefill.pool.free(src)
    decode.pool.free(dst)
    assert prefill.whole and decode.whole
    _assert_next_pull_works(prefill, decode, "after")


@pytest.mark.parametrize("where", ["both", "decode"])
def test_a_hole_on_both_sides_or_on_the_decode_only_moves_nothing_for_it(
    sides: tuple[Engine, Engine], where: str
) -> None:
    prefill, decode = sides
    src = prefill.allocate(TOKENS)
    params = prefill.side.request_finished("r", _with_hole(src, 0) if where == "both" else src, TOKENS)
    dst = decode.allocate(TOKENS)
    decode.side.start_pull("r", params, _with_hole(dst, 0))
    assert decode.wait("r").state == "done"
    assert prefill.wait("r").state == "done"
    for s, d in list(zip(src, dst))[1:]:
        assert _block(prefill, s) == _block(decode, d)
    assert _block(prefill, src[0]) != _block(decode, dst[0])  # nothing moved into the decode's hole position
    prefill.pool.free(src)
    decode.pool.free(dst)
    assert prefill.whole and decode.whole
