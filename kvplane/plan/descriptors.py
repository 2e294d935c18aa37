"""A copy plan: three int64 arrays of equal length, one descriptor per contiguous byte range.

Backends execute plans locally (D2H, H2D, D2D) and transports move them between ranks. Plans are built and
coalesced with array operations only; nothing here loops per block in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplane.errors import PlanError

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CopyPlan:
    src: Int64Array
    dst: Int64Array
    length: Int64Array

    def __post_init__(self) -> None:
        for name in ("src", "dst", "length"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 1:
                got = f"{arr.ndim}-D {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
                raise PlanError(f"CopyPlan.{name} must be a 1-D int64 numpy array, got {got}; use np.int64")
            if not arr.flags.c_contiguous:  # executors read the raw buffer; a strided view would be misread
                object.__setattr__(self, name, np.ascontiguousarray(arr))
        if not (self.src.shape == self.dst.shape == self.length.shape):
            raise PlanError(
                f"CopyPlan arrays differ in length: src={self.src.size}, dst={self.dst.size}, "
                f"length={self.length.size}"
            )
        if self.length.size and int(self.length.min()) <= 0:
            raise PlanError(f"CopyPlan.length holds {int(self.length.min())}; every descriptor must be > 0 bytes")

    @classmethod
    def empty(cls) -> CopyPlan:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy())

    @classmethod
    def concat(cls, plans: list[CopyPlan]) -> CopyPlan:
        if not plans:
            return cls.empty()
        return cls(
            np.concatenate([p.src for p in plans]),
            np.concatenate([p.dst for p in plans]),
            np.concatenate([p.length for p in plans]),
        )

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def coalesced(self) -> CopyPlan:
        """Merge each descriptor into its predecessor when both its src and dst follow on directly.

        Order is kept; only neighbours in plan order merge, so a plan sorted by destination merges best.
        """
        n = len(self)
        if n < 2:
            return self
        follows = (self.src[1:] == self.src[:-1] + self.length[:-1]) & (
            self.dst[1:] == self.dst[:-1] + self.length[:-1]
        )
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        if starts.size == n:
            return self
        ends = np.append(starts[1:], n)
        csum = np.concatenate(([0], np.cumsum(self.length)))
        return CopyPlan(self.src[starts], self.dst[starts], (csum[ends] - csum[starts]).astype(np.int64))

    def sorted_by_dst(self) -> CopyPlan:
        order = np.argsort(self.dst, kind="stable")
        return CopyPlan(self.src[order], self.dst[order], self.length[order])

    def check_within(self, side: str, spans: list[tuple[int, int]]) -> None:
        """Raise ``PlanError`` unless every ``side`` ("src"/"dst") range lies inside one of ``spans``."""
        if not len(self):
            return
        addrs = getattr(self, side)
        ends = addrs + self.length
        starts_sorted = np.array(sorted(s for s, _ in spans), dtype=np.int64)
        span_end = dict(spans)
        ends_sorted = np.array([span_end[int(s)] for s in starts_sorted], dtype=np.int64)
        idx = np.searchsorted(starts_sorted, addrs, side="right") - 1
        ok = (idx >= 0) & (ends <= ends_sorted[np.clip(idx, 0, None)])
        if not bool(ok.all()):
            bad = int(np.flatnonzero(~ok)[0])
            raise PlanError(
                f"descriptor {bad}: {side} range [{int(addrs[bad]):#x}, +{int(self.length[bad])}) lies outside "
                f"every registered region; build plans from the regions of the tensors being moved"
            )
