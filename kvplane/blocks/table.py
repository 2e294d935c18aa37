"""A request's block table: the block ids it holds in each KV-cache group, in token order."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvplane.errors import BlockError


class BlockTable:
    """Block ids per group for one request. Hybrid models have one list per KV-cache group."""

    def __init__(self, request_id: str, group_ids: tuple[int, ...] = (0,)) -> None:
        self.request_id = request_id
        self._blocks: dict[int, list[int]] = {g: [] for g in group_ids}

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    def append(self, group_id: int, block_ids: list[int] | npt.NDArray[np.int64]) -> None:
        self._group(group_id).extend(int(b) for b in block_ids)

    def ids(self, group_id: int) -> npt.NDArray[np.int64]:
        return np.asarray(self._group(group_id), dtype=np.int64)

    def as_lists(self) -> tuple[list[int], ...]:
        """vLLM's shape: one list per group, in group order."""
        return tuple(list(v) for v in self._blocks.values())

    def clear(self) -> dict[int, list[int]]:
        """Forget every block and return them per group (the caller frees them in its pool)."""
        out = {g: list(v) for g, v in self._blocks.items()}
        for v in self._blocks.values():
            v.clear()
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._blocks.values())

    def _group(self, group_id: int) -> list[int]:
        try:
            return self._blocks[group_id]
        except KeyError:
            raise BlockError(
                f"request {self.request_id!r}: group_id={group_id} is not in its table {self.group_ids}"
            ) from None
