"""The value types at the bottom of kvplane: ``Region`` (where a slot's blocks sit) and ``CopyPlan`` (what to move).

Layouts produce regions from engine tensors, manifests carry them to peers, the planner turns block ids into
copy plans, and backends and transports execute those plans. Every layer imports these two types from here, so
``backend/`` and ``transports/`` never reach up into ``kv/`` or ``plan/``. This module imports nothing of kvplane
but its errors.

A region never owns memory: it borrows the engine's tensor, which must outlive every plan built from it. A copy
plan is three int64 arrays of equal length, one descriptor per contiguous byte range, built and coalesced with
array operations only.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from kvplane.errors import LayoutError, PlanError

Int64Array = npt.NDArray[np.int64]

class Region(msgspec.Struct, frozen=True):
    """Block ``i`` of this region is ``block_bytes`` bytes at ``addr + i * block_stride``.

    ``slot`` is a spec slot (``k``, ``kv_c``...) or, for layouts that interleave slots per token, their fused
    name (``kv_c+k_pe``). Inside a block, ``order`` ``"NHD"`` means token-major (token stride =
    ``heads * head_bytes``), ``"HND"`` head-major (head stride = ``tokens_per_block * head_bytes``).
    """

    group_id: int
    layer: int
    layer_name: str
    slot: str
    addr: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    tokens_per_block: int
    heads: int
    head_bytes: int
    order: str = "NHD"

    def __post_init__(self) -> None:  # runs on decode too, so a malformed peer manifest is rejected here
        if self.num_blocks < 1 or self.block_bytes < 1 or self.block_stride < self.block_bytes:
            raise LayoutError(
                f"region {self.layer_name!r}/{self.slot!r}: num_blocks={self.num_blocks}, block_bytes="
                f"{self.block_bytes}, block_stride={self.block_stride}; need >= 1 block, > 0 bytes, no overlap"
            )
        if self.order not in ("NHD", "HND"):
            raise LayoutError(f"region {self.layer_name!r}/{self.slot!r}: order={self.order!r}, use NHD or HND")

    @property
    def end(self) -> int:
        """One past the last byte any block of this region can touch."""
        return self.addr + (self.num_blocks - 1) * self.block_stride + self.block_bytes

    @property
    def span(self) -> int:
        return self.end - self.addr

    def block_addrs(self, block_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Start addresses of the given blocks; out-of-range ids raise ``PlanError`` naming the region."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise PlanError(
                f"block id {bad} is out of range for layer {self.layer_name!r} slot {self.slot!r}: "
                f"it has blocks 0..{self.num_blocks - 1}; pass ids the engine allocated from this cache"
            )
        return self.addr + ids * self.block_stride


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
