"""Block ids (or hashes) per KV-cache group, as flows take them from engines.

An engine with one KV-cache group may pass one sequence; a hybrid model passes ``{group_id: ids}``. Flows
normalise both to ``{group: int64 array}`` here, with an error of the caller's type naming what was wrong.

A position may be a ``HOLE``: the request holds no block there (a sliding-window group's positions that fell out
of the window, which vLLM fills with its null block). Nothing moves for a hole's tokens, on either side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeGuard

import numpy as np

from kvplane.descriptors import Int64Array as Ids  # the one definition of an int64 id array
from kvplane.errors import BlockError

__all__ = ["HOLE", "INT64", "Ids", "PerGroup", "is_ids", "per_group", "table_problem"]

PerGroup = Sequence[int] | Ids | Mapping[int, Sequence[int] | Ids]
HOLE = -1  # a block-table position without a block: nothing moves for its tokens
# int64's dtype (a singleton): ``arr.dtype is INT64`` is one pointer test, where ``arr.dtype == np.int64`` first
# converts the type into a dtype; with the caches cold at the start of a request every such detour costs
INT64 = np.dtype(np.int64)


def is_ids(arr: object) -> TypeGuard[Ids]:
    """Whether ``arr`` is already a 1-D contiguous int64 array (what flows and the native calls take as it is)."""
    return type(arr) is np.ndarray and arr.dtype is INT64 and arr.ndim == 1 and arr.flags.c_contiguous


def per_group(
    what: str, value: PerGroup, group_ids: Sequence[int], error: type[Exception] = BlockError
) -> dict[int, Ids]:
    """``{group: int64 ids}`` from a mapping, or from one sequence when the model has a single KV-cache group.
    A contiguous 1-D int64 array is taken as it is (the engine's hot path hands one per request)."""
    ready = value if is_ids(value) else None
    if ready is None and isinstance(value, Mapping):
        unknown = sorted(set(value) - set(group_ids))
        if unknown:
            raise error(f"{what} has group id(s) {unknown}; this model's groups are {list(group_ids)}")
        return {int(g): np.asarray(v, dtype=np.int64).ravel() for g, v in value.items()}
    if len(group_ids) != 1:
        raise error(f"{what} is one sequence but the model has KV-cache groups {list(group_ids)}; pass {{group_id: ...}}")
    return {group_ids[0]: ready if ready is not None else np.asarray(value, dtype=np.int64).ravel()}


def table_problem(ids: Ids, pool: int, *, distinct: bool) -> str:
    """Why one group's block ids cannot be right for a cache of ``pool`` blocks, "" when they can: an id outside
    ``0..pool-1`` other than a ``HOLE``, or, where ``distinct`` (destinations), one id twice."""
    real = ids[ids != HOLE]
    if real.size and (int(real.min()) < 0 or int(real.max()) >= pool):
        return (f"block ids must lie in 0..{pool - 1} (the cache's blocks) or be {HOLE} (no block at that "
                f"position), got {int(real.min())}..{int(real.max())}")
    if distinct and np.unique(real).size != real.size:
        return (f"a destination block id appears twice; each block receives one block of KV, pass distinct ids "
                f"({HOLE} for a position without a block)")
    return ""
