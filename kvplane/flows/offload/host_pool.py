"""Host memory of the offload tier, laid out as regions that mirror the device's.

One buffer per KV-cache group, from ``backend.alloc_host`` (pinned where the device supports it). A host block
holds one KV block of every layer and slot of its group, back to back in region order, so a host block is one
contiguous range (one object in the store). Each device region gets a host twin with the same ``block_bytes``,
``addr = buffer + offset of that slot in a host block`` and ``block_stride = host block bytes``; then
``block_copy_plan(device_regions, device_ids, host_regions, host_ids)`` maps block ids to addresses with array
operations, for any layout the device uses.

Every group gets the same number of host blocks, the most that fit in ``host_bytes`` together; the pool never
allocates more than ``host_bytes``. The engine owns the pool; nothing else writes its memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvplane.backend.base import Backend
from kvplane.descriptors import Region
from kvplane.flows.offload.errors import OffloadConfigError

if TYPE_CHECKING:
    import torch


class HostPool:
    def __init__(self, backend: Backend, device_regions: Sequence[Region], host_bytes: int, pinned: bool = True):
        by_group: dict[int, list[Region]] = {}
        for r in device_regions:
            by_group.setdefault(r.group_id, []).append(r)
        self.block_bytes: dict[int, int] = {g: sum(r.block_bytes for r in rs) for g, rs in by_group.items()}
        per_block = sum(self.block_bytes.values())
        self.num_blocks = host_bytes // per_block if per_block else 0
        if self.num_blocks < 1:
            raise OffloadConfigError(
                f"OffloadConfig.host_bytes={host_bytes} holds no host block: one block of every group takes "
                f"{per_block} B; configure host_bytes >= {per_block} (ideally many times more)"
            )
        self.buffers: dict[int, torch.Tensor] = {}
        self.regions: dict[str, list[Region]] = {}  # layer name -> host twins of its device regions, in order
        for group, regions in by_group.items():
            buf = backend.alloc_host(self.num_blocks * self.block_bytes[group], pinned=pinned)
            self.buffers[group] = buf
            offset = 0
            for r in regions:
                twin = msgspec.structs.replace(
                    r,
                    addr=buf.data_ptr() + offset,
                    num_blocks=self.num_blocks,
                    block_stride=self.block_bytes[group],
                )
                self.regions.setdefault(r.layer_name, []).append(twin)
                offset += r.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of host memory this pool holds (never more than the configured ``host_bytes``)."""
        return sum(int(b.numel()) for b in self.buffers.values())

    def block(self, group: int, block_id: int) -> torch.Tensor:
        """A view of one host block's bytes (tests and the bench compare it)."""
        n = self.block_bytes[group]
        return self.buffers[group][block_id * n : (block_id + 1) * n]
