"""Prefix hashes chained per KV-cache group: hash(parent, group, token ids of one full block).

Two requests that share their first n full blocks share their first n hashes, so a hash names a prefix, not
a block's content alone. Only full blocks are hashed; a partial tail block is never cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvplane.errors import SpecError

ROOT_HASH = 0
_MASK = (1 << 63) - 1  # keep hashes non-negative int64, so they fit numpy arrays and msgpack ints


def block_hash(parent: int, group_id: int, tokens: Sequence[int] | np.ndarray) -> int:
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(group_id.to_bytes(4, "little", signed=False))
    h.update(data)
    return int.from_bytes(h.digest(), "little") & _MASK


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, tokens_per_block: int, group_id: int = 0, parent: int = ROOT_HASH
) -> list[int]:
    """The chained hash of every full block of ``token_ids``."""
    if tokens_per_block < 1:
        raise SpecError(f"tokens_per_block={tokens_per_block} must be >= 1")
    if group_id < 0:
        raise SpecError(f"group_id={group_id} must be >= 0 (KV-cache group ids count from 0)")
    tokens = np.asarray(token_ids, dtype=np.int64)
    full = len(tokens) // tokens_per_block
    out: list[int] = []
    for row in tokens[: full * tokens_per_block].reshape(full, tokens_per_block):
        parent = block_hash(parent, group_id, row)
        out.append(parent)
    return out
