"""A decode rank that holds the first tokens of a request already (vLLM's prefix cache found them) receives only
the rest: ``start_pull`` / ``register_push`` take ``local_tokens`` per KV-cache group, and the transfer moves the
remote blocks after them into the matching local blocks. Real sides in this process on 127.0.0.1 (Mooncake).

The decode's blocks are filled with a marker first: a block the transfer leaves out keeps it, every other token
ends equal to the prefill's. Where the block sizes differ, the transfer starts at the last token boundary both
sides' blocks share (``lcm`` of the sizes) at or before ``local_tokens``: the decode blocks from there are moved
again. A TP-2 prefill feeding a TP-1 decode stages token-major head slices and re-lays them out (pull in chunks,
push whole): the staged path skips the same blocks. ``Completion.skipped_blocks`` counts the blocks left out.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kvfill import mark, unmarked
from kvref import canonical
from pair import Engine, make, prefill_ranks, push_params, small_spec, token_for

from kvplane.errors import KvplaneError
from kvplane.kv.spec import KVSpec

pytestmark = pytest.mark.integration
TOKENS, MARK = 100, 7.0
CASES = {  # prefill block, decode block, prefill TP (the decode has TP 1), tokens the decode holds
    "same-blocks": (16, 16, 1, 48),
    "prefill-32-decode-16": (32, 16, 1, 48),  # lcm 32: decode block 2 (tokens 32..47) is moved again
    "prefill-16-decode-32": (16, 32, 1, 64),
    "tp2-to-tp1-staged": (16, 16, 2, 48),
}


def gqa(block: int, heads: int = 4) -> KVSpec:
    return KVSpec.gqa(4, heads, 32, tokens_per_block=block, dtype="float32")


def landed_after(first: int, decode: Engine, d_ids: list[int], ranks: list[Engine], p_ids: list[list[int]]) -> bool:
    """Tokens ``first`` .. TOKENS of every layer equal on both sides (heads of the prefill ranks side by side)."""
    for layer in decode.spec.layers:
        got = canonical(decode.layout, decode.cache[layer.name], np.asarray(d_ids), TOKENS, layer)
        parts = [canonical(r.layout, r.cache[layer.name], np.asarray(ids), TOKENS, r.spec.layer(layer.name))
                 for r, ids in zip(ranks, p_ids)]
        for slot in got:
            want = torch.cat([p[slot] for p in parts], dim=1)
            if not torch.equal(got[slot][first:].contiguous().view(torch.int32),
                               want[first:].contiguous().view(torch.int32)):
                return False
    return True


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_decode_holding_the_first_tokens_receives_only_the_rest(case: str, mode: str) -> None:
    p_block, d_block, tp, held = CASES[case]
    first = held // math.lcm(p_block, d_block) * math.lcm(p_block, d_block)
    ranks = prefill_ranks(gqa(p_block, 4 // tp), ["packed_kv"] * tp, seed=5, mode=mode)
    decode = make("decode", gqa(d_block), mode=mode)
    try:
        d_ids = decode.allocate(TOKENS)
        mark(decode.spec, decode.cache, decode.layout, {0: d_ids}, MARK)
        p_ids = [r.allocate(TOKENS) for r in ranks]
        if mode == "pull":
            params = [r.side.request_finished("r", ids, TOKENS, token=token_for("r")) for r, ids in zip(ranks, p_ids)]
            decode.side.start_pull("r", params[0], d_ids, local_tokens={0: held})
        else:
            push = push_params(ranks[0].side.base_port, "r", ranks[0].side.config.engine_id, tp)
            decode.side.register_push("r", push, d_ids, TOKENS, local_tokens={0: held})
            for r, ids in zip(ranks, p_ids):
                r.side.request_finished("r", ids, TOKENS, token=token_for("r"))
        done = decode.wait("r")
        assert done.state == "done", done.reason
        kept = d_ids[: first // d_block]
        changed, total = unmarked(decode.spec, decode.cache, decode.layout, {0: kept}, MARK)
        assert changed == 0 < total, f"{changed} of {total} kept block slots were written"
        assert landed_after(first, decode, d_ids, ranks, p_ids)
        assert done.skipped_blocks == len(kept) > 0
        assert [r.wait("r").state for r in ranks] == ["done"] * tp
    finally:
        decode.close()
        for r in ranks:
            r.close()


def test_local_tokens_for_a_group_the_model_lacks_are_refused_naming_it() -> None:
    prefill = make("prefill", small_spec(), seed=5)
    decode = make("decode", small_spec())
    try:
        params = prefill.side.request_finished("r", prefill.allocate(TOKENS), TOKENS)
        with pytest.raises(KvplaneError, match=r"local_tokens=\{3: 16\} names groups \[3\]"):
            decode.side.start_pull("r", params, decode.allocate(TOKENS), local_tokens={3: 16})
    finally:
        decode.close()
        prefill.close()
