"""What the store tier answered for each request's lookup, kept for that request's load.

The scheduler-side lookup asks the store which blocks it holds (outside the engine's lock); the load of the same
request, a step later and under the lock, reads that answer instead of asking again. A load takes its keys from
the first block vLLM does not hold, so it asks for a run of the lookup's keys: the answer for that run is the
matching slice. Any other keys get no answer (the caller asks the store).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import Ids

BoolArray = npt.NDArray[np.bool_]
InStore = dict[int, BoolArray]  # per group: which of a lookup's blocks the store tier holds


class LookupAnswers:
    def __init__(self) -> None:
        self._by_request: dict[str, tuple[dict[int, Ids], InStore]] = {}  # the keys asked per group, the answer

    def __len__(self) -> int:
        return len(self._by_request)

    def remember(self, request_id: str, asked: dict[int, Ids], in_store: InStore) -> None:
        """Keep ``in_store``, the answer for ``asked`` (per group), until ``forget`` (a newer lookup replaces it)."""
        self._by_request[request_id] = (asked, in_store)

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def find(self, request_id: str, group: int, keys: Ids) -> BoolArray | None:
        """The kept answer for ``keys`` of ``group`` (a run of the keys the lookup asked), or None when the
        request's lookup asked for other keys, or none was kept."""
        known = self._by_request.get(request_id)
        if known is None or group not in known[0] or group not in known[1]:
            return None
        asked, found = known[0][group], known[1][group]
        if not len(keys):
            return np.zeros(0, dtype=bool)
        at = np.flatnonzero(asked == keys[0])
        if not at.size:
            return None
        a = int(at[0])
        if a + len(keys) > len(asked) or not np.array_equal(asked[a : a + len(keys)], keys):
            return None
        return found[a : a + len(keys)]
