"""Holes in a block table (``HOLE``, -1: a position without a block, as a sliding-window group's positions out of
the window): nothing moves for a token in a destination hole, and every other token lands exactly. A token in a
source hole whose destination is a real block is refused (that block would keep stale KV).

vLLM hands such positions to a connector as its null block; the connector passes them on as holes
(``tests/vllm/test_vllm_hybrid_pd.py`` runs that under vLLM's own Scheduler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import GQA_LAYOUTS, Rank, cpu

from kvplane.blocks.groups import HOLE, table_problem
from kvplane.errors import PlanError
from kvplane.plan.planner import plan_transfer
from kvplane.plan.tokens import token_chunks

NUM_BLOCKS = 24


def table(n: int, block: int, holes: int, seed: int) -> np.ndarray:
    """Distinct ids for ``n`` tokens, the first ``holes`` positions (at most all but the last) holes."""
    ids = np.random.default_rng(seed).choice(NUM_BLOCKS, -(-n // block), replace=False).astype(np.int64)
    ids[: min(holes, ids.size - 1)] = HOLE
    return ids


def per_token(ids: np.ndarray, block: int, n: int) -> np.ndarray:
    return np.asarray(ids[np.arange(n) // block] != HOLE)


@settings(max_examples=40, deadline=None, database=None)
@given(
    n=st.integers(1, 150),
    src_block=st.sampled_from([8, 16, 32]),
    dst_block=st.sampled_from([8, 16, 32]),
    src_holes=st.integers(0, 6),
    dst_holes=st.integers(0, 6),
    layout=st.sampled_from(GQA_LAYOUTS),
    seed=st.integers(0, 1000),
)
def test_tokens_in_a_destination_hole_are_left_every_other_token_lands_and_a_source_only_hole_is_refused(
    n: int, src_block: int, dst_block: int, src_holes: int, dst_holes: int, layout: str, seed: int
) -> None:
    src = Rank("gqa", layout, 1, 0, src_block, NUM_BLOCKS, seed=1)
    dst = Rank("gqa", layout, 1, 0, dst_block, NUM_BLOCKS, seed=2)
    s_ids, d_ids = table(n, src_block, src_holes, seed), table(n, dst_block, dst_holes, seed + 1)
    spare = np.setdiff1d(np.arange(NUM_BLOCKS), d_ids[d_ids != HOLE])
    before = {name: dst.tokens(name, spare, 10**6) for name in dst.spec.layer_names}
    unfilled = ~per_token(s_ids, src_block, n) & per_token(d_ids, dst_block, n)
    if unfilled.any():
        pos = int(np.argmax(unfilled)) // src_block
        with pytest.raises(PlanError, match=rf"group 0: source block position {pos} .* HOLE .* stale KV"):
            plan_transfer(src.manifest, dst.manifest, {0: s_ids}, {0: d_ids}, {0: n})
        return
    tp = plan_transfer(src.manifest, dst.manifest, {0: s_ids}, {0: d_ids}, {0: n})
    cpu.execute(tp.plan)
    moved = per_token(s_ids, src_block, n) & per_token(d_ids, dst_block, n)
    s_real, d_real = np.where(s_ids == HOLE, spare[0], s_ids), np.where(d_ids == HOLE, spare[0], d_ids)
    for name in dst.spec.layer_names:
        want, got = src.tokens(name, s_real, n), dst.tokens(name, d_real, n)
        for slot in want:
            torch.testing.assert_close(got[slot][moved], want[slot][moved], rtol=0, atol=0)
        after = dst.tokens(name, spare, 10**6)
        for slot in after:  # blocks the table does not hold (a hole's stand-in among them) are never written
            torch.testing.assert_close(after[slot], before[name][slot], rtol=0, atol=0)
    assert tp.direct_bytes == tp.plan.total_bytes


def test_chunks_in_a_hole_are_left_out() -> None:
    ch = token_chunks(64, np.array([HOLE, 5, 6, 7]), 16, np.array([HOLE, HOLE, 2, 3, 4, 5, 6, 7]), 8, "group 1")
    assert (ch.count, ch.tokens) == (6, 8)
    assert ch.src_block.tolist() == [5, 5, 6, 6, 7, 7] and ch.src_token.tolist() == [0, 8, 0, 8, 0, 8]
    assert ch.dst_block.tolist() == [2, 3, 4, 5, 6, 7] and not ch.dst_token.any()


def test_a_chunk_in_a_source_hole_over_a_real_destination_block_is_refused_naming_group_position_and_fix() -> None:
    with pytest.raises(PlanError, match=r"group 1: source block position 1 \(tokens 16\.\.23\) is a HOLE .* "
                                        r"destination block there is 3, .* stale KV; give the destination a HOLE"):
        token_chunks(64, np.array([HOLE, HOLE, 6, 7]), 16, np.array([HOLE, HOLE, 3, 4, 5, 6, 7, 8]), 8, "group 1")
    # past num_tokens (outside the transfer window) a source hole is not read
    assert token_chunks(16, np.array([4, HOLE]), 16, np.array([3, 5]), 16, "group 1").count == 1


def test_a_layer_that_must_be_staged_refuses_holes_naming_the_fix() -> None:
    src, dst = Rank("gqa", "packed_kv", 1, 0, 16, 8, 1), Rank("gqa", "packed_kv", 2, 1, 16, 8, 2)
    ids = np.array([HOLE, 1, 2], dtype=np.int64)
    with pytest.raises(PlanError, match=r"must be staged .* holes .* same layout and TP size"):
        plan_transfer(src.manifest, dst.manifest, {0: ids}, {0: ids}, {0: 48}, staging=(0, 1 << 30))


@pytest.mark.parametrize(("ids", "distinct", "problem"), [
    ([HOLE, HOLE, 3, 4], True, ""),
    ([HOLE, 3, 3], True, "appears twice"),
    ([3, 3], False, ""),
    ([-2, 3], False, "or be -1"),
    ([HOLE, 8], False, "0..7"),
])
def test_a_table_may_hold_holes_but_no_other_negative_or_out_of_range_id(
    ids: list[int], distinct: bool, problem: str
) -> None:
    got = table_problem(np.array(ids, dtype=np.int64), 8, distinct=distinct)
    assert (problem in got) if problem else got == ""


def _register(ids: list[int]) -> bytes:
    from kvplane.flows.disagg.wire.messages import PushRegister, encode

    return encode(PushRegister("r", "e", 0, 1, {1: ids}, 16, 0, 0, "boot"))


def test_a_push_registration_carries_holes_and_refuses_other_negative_ids() -> None:
    from kvplane.flows.disagg.wire.errors import ProtocolError
    from kvplane.flows.disagg.wire.messages import decode

    assert decode(_register([HOLE, 7]), 1 << 20).block_ids == {1: [HOLE, 7]}  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="block_ids"):
        decode(_register([-2, 7]), 1 << 20)


def test_transfer_params_carry_holes_and_name_any_other_negative_id() -> None:
    from kvplane.flows.disagg.wire.errors import TransferParamsError
    from kvplane.flows.disagg.wire.params import TransferParams

    raw = {"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600,
           "tp_size": 1, "remote_block_ids": [[1, 2], [HOLE, 3]]}
    assert TransferParams.from_dict(raw).remote_block_ids == [[1, 2], [HOLE, 3]]
    with pytest.raises(TransferParamsError, match=r"remote_block_ids\[1\] holds block id -2"):
        TransferParams.from_dict({**raw, "remote_block_ids": [[1, 2], [-2, 3]]})
