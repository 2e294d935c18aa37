"""Token chunks: how the tokens of one request map onto blocks of two different block sizes.

Both sides cut the request into chunks of ``gcd(src_block, dst_block)`` tokens; chunk ``c`` sits at a known
block and token offset on each side, and is contiguous in a token-major block on both. A chunk whose destination
is a ``HOLE`` (a position without a block, as out of a sliding window) is left out: nothing moves for it, whatever
the source holds there. A chunk whose source is a hole but whose destination is a real block is refused
(``PlanError``): nothing could fill that block, which would keep stale KV the engine then reads as the request's.
Everything here is numpy arrays, one entry per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvplane.blocks.groups import HOLE
from kvplane.descriptors import Int64Array as I64
from kvplane.errors import PlanError


@dataclass(frozen=True)
class Chunks:
    tokens: int  # tokens per chunk
    count: int
    src_block: I64  # block id on the source side
    src_token: I64  # first token of the chunk inside that block
    dst_block: I64
    dst_token: I64


def token_chunks(num_tokens: int, src_ids: I64, src_block: int, dst_ids: I64, dst_block: int, where: str) -> Chunks:
    """Chunks covering ``num_tokens`` tokens; the block lists must hold them (``PlanError`` otherwise)."""
    if num_tokens < 0:
        raise PlanError(f"{where}: num_tokens={num_tokens} must be >= 0")
    for side, ids, size in (("source", src_ids, src_block), ("destination", dst_ids, dst_block)):
        if len(ids) * size < num_tokens:
            raise PlanError(
                f"{where}: {num_tokens} tokens need {-(-num_tokens // size)} {side} blocks of {size} tokens, "
                f"got {len(ids)}; pass every block the request holds"
            )
    g = math.gcd(src_block, dst_block)
    count = -(-num_tokens // g)
    first = np.arange(count, dtype=np.int64) * g
    src, dst = src_ids[first // src_block], dst_ids[first // dst_block]
    unfilled = (src == HOLE) & (dst != HOLE)
    if unfilled.any():
        c = int(np.argmax(unfilled))
        pos, tok = int(first[c] // src_block), int(first[c])
        raise PlanError(
            f"{where}: source block position {pos} (tokens {tok}..{min(tok + g, num_tokens) - 1}) is a HOLE "
            f"({HOLE}: the source holds no KV there) but the destination block there is {int(dst[c])}, which "
            f"would keep stale KV; give the destination a HOLE at that position too (vLLM's null block: serve the "
            f"same model, with the same sliding window, on both sides), or transfer only tokens the source holds"
        )
    if (dst == HOLE).any():  # a source hole has a destination hole by now: one mask leaves out both
        keep = dst != HOLE
        first, src, dst, count = first[keep], src[keep], dst[keep], int(keep.sum())
    return Chunks(
        tokens=g,
        count=count,
        src_block=src,
        src_token=first % src_block,
        dst_block=dst,
        dst_token=first % dst_block,
    )
