"""vLLM CUDA GQA/MHA: one tensor per layer, ``(2, nb, bs, h, d)``; index 0 holds k, index 1 holds v."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch


class GqaFused(Layout):
    name = "gqa_fused"
    family = "gqa"
    shape = "(2, nb, bs, h, d)"

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        (t,) = as_tuple(self, layer, value, (1,))
        k = layer.slot("k")
        expect_shape(self, layer, "kv", t, (2, None, tokens_per_block, k.heads, k.head_dim))
        return [SlotTensor(name, t[i], k.dtype, k.heads, k.head_dim) for i, name in enumerate(("k", "v"))]

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        k = layer.slot("k")
        shape = (2, num_blocks, tokens_per_block, k.heads, k.head_dim)
        return torch.zeros(shape, dtype=torch_dtype(k.dtype), device=device)
