"""Split k/v (vllm-ascend): two tensors per layer, k and v, each ``(nb, bs, h, d)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec, SlotSpec

if TYPE_CHECKING:
    import torch


class SplitKV(Layout):
    name = "split_kv"
    family = "gqa"
    shape = "k, v: (nb, bs, h, d)"

    def block_shape(self, slot: SlotSpec, tokens_per_block: int) -> tuple[int, int, int]:
        """The shape of one block of one slot (token-major here)."""
        return (tokens_per_block, slot.heads, slot.head_dim)

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        tensors = as_tuple(self, layer, value, (2,))
        out = []
        for name, t in zip(("k", "v"), tensors):
            s = layer.slot(name)
            expect_shape(self, layer, name, t, (None, *self.block_shape(s, tokens_per_block)))
            out.append(SlotTensor(name, t, s.dtype, s.heads, s.head_dim))
        return out

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        return tuple(
            torch.zeros((num_blocks, *self.block_shape(s, tokens_per_block)), dtype=torch_dtype(s.dtype), device=device)
            for s in (layer.slot("k"), layer.slot("v"))
        )
