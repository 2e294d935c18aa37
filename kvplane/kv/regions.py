"""Regions (BufferDescs): one registered address range holding one slot of one layer for all blocks.

Layout specs produce regions from engine tensors; manifests carry them to peers; planners turn block ids into
byte ranges with ``addr + block_id * block_stride``. A region never owns memory: it borrows the engine's tensor,
which must outlive every plan built from it.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

from kvplane.errors import LayoutError, PlanError


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
