"""The staging arena: byte ranges of one registered destination buffer, lent to transfers that re-lay out.

A transfer whose bytes cannot land directly (heterogeneous TP with token-major blocks, fused against split
MLA) lands whole source blocks here, then ``plan.relayout`` copies them into the cache. Each such request
takes one range for its lifetime: a pull one or two chunks' worth, reused chunk after chunk
(``staged_pull``), a push the whole request. First fit over a sorted free list, ranges aligned to 64 bytes.
Pure bookkeeping: the buffer itself belongs to ``LocalKV``.
"""

from __future__ import annotations

from kvplane.flows.disagg.wire.errors import DisaggError

ALIGN = 64


class StagingArena:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), sorted
        self._taken: dict[int, int] = {}

    def take(self, nbytes: int) -> int | None:
        """The offset of a free range of ``nbytes``, or None while none is free (try again later)."""
        if nbytes > self.size:
            raise DisaggError(
                f"a transfer must stage {nbytes} B but DisaggConfig.staging_bytes={self.size}; raise it to at "
                f"least {nbytes}"
            )
        aligned = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= nbytes:  # less than ``aligned`` only for the buffer's unaligned tail: take all of it
                need = min(aligned, length)
                rest = (offset + need, length - need)
                self._free[i : i + 1] = [rest] if rest[1] else []
                self._taken[offset] = need
                return offset
        return None

    def give(self, offset: int) -> None:
        length = self._taken.pop(offset)
        self._free.append((offset, length))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    @property
    def in_use(self) -> int:
        return sum(self._taken.values())
