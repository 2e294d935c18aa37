"""Block ids (or hashes) per KV-cache group, as flows take them from engines.

An engine with one KV-cache group may pass one sequence; a hybrid model passes ``{group_id: ids}``. Flows
normalise both to ``{group: int64 array}`` here, with an error of the caller's type naming what was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvplane.descriptors import Int64Array as Ids  # the one definition of an int64 id array
from kvplane.errors import BlockError

__all__ = ["Ids", "PerGroup", "per_group"]

PerGroup = Sequence[int] | Ids | Mapping[int, Sequence[int] | Ids]


def per_group(
    what: str, value: PerGroup, group_ids: Sequence[int], error: type[Exception] = BlockError
) -> dict[int, Ids]:
    """``{group: int64 ids}`` from a mapping, or from one sequence when the model has a single KV-cache group.
    A contiguous 1-D int64 array is taken as it is (the engine's hot path hands one per request)."""
    ready = value if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1 \
        and value.flags.c_contiguous else None
    if ready is None and isinstance(value, Mapping):
        unknown = sorted(set(value) - set(group_ids))
        if unknown:
            raise error(f"{what} has group id(s) {unknown}; this model's groups are {list(group_ids)}")
        return {int(g): np.asarray(v, dtype=np.int64).ravel() for g, v in value.items()}
    if len(group_ids) != 1:
        raise error(f"{what} is one sequence but the model has KV-cache groups {list(group_ids)}; pass {{group_id: ...}}")
    return {group_ids[0]: ready if ready is not None else np.asarray(value, dtype=np.int64).ravel()}
