"""A sparse-attention indexer cache kept as a layer of its own (vLLM's DeepSeek V3.2): ``(nb, bs, index_dim)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch


class IndexSlot(Layout):
    name = "index"
    family = "index"
    shape = "(nb, bs, index_dim)"

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        (t,) = as_tuple(self, layer, value, (1,))
        s = layer.slot("index")
        expect_shape(self, layer, "index", t, (None, tokens_per_block, s.heads * s.head_dim))
        return [SlotTensor("index", t, s.dtype, s.heads, s.head_dim)]

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        s = layer.slot("index")
        shape = (num_blocks, tokens_per_block, s.heads * s.head_dim)
        return torch.zeros(shape, dtype=torch_dtype(s.dtype), device=device)
