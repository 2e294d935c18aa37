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

class SlotPart(msgspec.Struct, frozen=True, array_like=True):
    """One spec slot's share of a row: ``nbytes`` bytes at ``offset`` of every (token, head) row of a region.

    vLLM packs K and V in one row of ``2 * head`` elements: K is ``SlotPart("k", 0, head_bytes)`` and V
    ``SlotPart("v", head_bytes, head_bytes)``; MLA's 576-wide row holds ``kv_c`` then ``k_pe``.
    """

    slot: str
    offset: int
    nbytes: int


class Region(msgspec.Struct, frozen=True):
    """Block ``i`` of this region is ``block_bytes`` contiguous bytes at ``addr + i * block_stride``.

    A block holds ``tokens_per_block x heads`` rows of ``row_bytes``; ``order`` ``"NHD"`` means token-major
    (token stride ``heads * row_bytes``), ``"HND"`` head-major (head stride ``tokens_per_block * row_bytes``).
    ``parts`` say which spec slots each row holds and where; ``slot`` joins their names (``k+v``, ``kv_c+k_pe``,
    ``k``). All of it is read from the engine tensor's shape, strides and storage offset, never assumed.
    """

    group_id: int
    layer: int
    layer_name: str
    addr: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    tokens_per_block: int
    heads: int
    row_bytes: int
    parts: tuple[SlotPart, ...]
    order: str = "NHD"

    def __post_init__(self) -> None:  # runs on decode too, so a malformed peer manifest is rejected here
        where = f"region {self.layer_name!r}"
        if self.num_blocks < 1 or self.block_bytes < 1 or self.block_stride < self.block_bytes:
            raise LayoutError(
                f"{where}: num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, block_stride="
                f"{self.block_stride}; need >= 1 block, > 0 bytes, no overlap"
            )
        if self.order not in ("NHD", "HND"):
            raise LayoutError(f"{where}: order={self.order!r}, use NHD or HND")
        if self.tokens_per_block < 1 or self.heads < 1 or self.row_bytes < 1:
            raise LayoutError(
                f"{where}: tokens_per_block={self.tokens_per_block}, heads={self.heads}, row_bytes="
                f"{self.row_bytes}; each must be >= 1"
            )
        if self.block_bytes != self.tokens_per_block * self.heads * self.row_bytes:
            raise LayoutError(
                f"{where}: block_bytes={self.block_bytes} is not tokens_per_block x heads x row_bytes = "
                f"{self.tokens_per_block} x {self.heads} x {self.row_bytes}"
            )
        edge = 0
        for part in self.parts:
            if part.offset < edge or part.nbytes < 1 or part.offset + part.nbytes > self.row_bytes:
                raise LayoutError(
                    f"{where}: slot part {part.slot!r} at offset {part.offset} (+{part.nbytes} B) overlaps "
                    f"another or leaves the {self.row_bytes}-byte row; parts must be in order, inside the row"
                )
            edge = part.offset + part.nbytes
        if not self.parts:
            raise LayoutError(f"{where}: a region holds at least one slot part")

    @property
    def slot(self) -> str:
        """The spec slots this region holds, joined: ``k``, ``k+v``, ``kv_c+k_pe``."""
        return "+".join(part.slot for part in self.parts)

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

    @classmethod
    def merge_parallel(cls, plans: list[CopyPlan]) -> CopyPlan:
        """Concatenate plans of equal length whose i-th descriptors may sit side by side in memory.

        Plan ``j`` usually moves the blocks of layer ``j``. In a cross-layer cache block ``i`` of layer ``j + 1``
        starts where layer ``j``'s ends, on both sides; then the plans are interleaved block-major so that
        ``coalesced`` makes one descriptor per block for all layers. Otherwise they are concatenated as given,
        which keeps runs of consecutive blocks of one layer together. Plans of unequal length are concatenated.
        """
        if len(plans) == 1:
            return plans[0]
        if not plans or len({len(p) for p in plans}) != 1 or not len(plans[0]):
            return cls.concat(plans)
        src = np.stack([p.src for p in plans])
        dst = np.stack([p.dst for p in plans])
        length = np.stack([p.length for p in plans])
        side_by_side = (src[1:, 0] == src[:-1, 0] + length[:-1, 0]) & (dst[1:, 0] == dst[:-1, 0] + length[:-1, 0])
        if not bool(side_by_side.any()):
            return cls(src.ravel(), dst.ravel(), length.ravel())
        return cls(src.T.ravel(), dst.T.ravel(), length.T.ravel())

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
        starts_sorted = np.array(sorted(s for s, _ in spans), dtype=np.int64)
        span_end = dict(spans)
        ends_sorted = np.array([span_end[int(s)] for s in starts_sorted], dtype=np.int64)
        ok = inside(addrs, self.length, starts_sorted, ends_sorted)
        if not bool(ok.all()):
            bad = int(np.flatnonzero(~ok)[0])
            raise PlanError(
                f"descriptor {bad}: {side} range [{int(addrs[bad]):#x}, +{int(self.length[bad])}) lies outside "
                f"every registered region; build plans from the regions of the tensors being moved"
            )


def inside(addrs: Int64Array, lengths: Int64Array, starts: Int64Array, ends: Int64Array) -> npt.NDArray[np.bool_]:
    """Per range ``[addr, addr + length)``: whether it lies inside one span ``[starts[i], ends[i])`` (spans sorted by
    start, disjoint); one ``searchsorted``."""
    if not len(starts):
        return np.zeros(len(addrs), bool)
    idx = np.searchsorted(starts, addrs, side="right") - 1
    return (idx >= 0) & (addrs + lengths <= ends[np.clip(idx, 0, None)])
