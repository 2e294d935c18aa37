"""vLLM CUDA MLA: one tensor per layer, ``(nb, bs, kv_lora_rank + rope_dim)`` (512 + 64 = 576 for DeepSeek).

Each token row holds ``kv_c`` then ``k_pe``, so the two slots interleave per token; the region is the fused
slot ``kv_c+k_pe``. Moving it to a split layout needs staging and a re-layout (the planner's job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch

FUSED_SLOT = "kv_c+k_pe"


class MlaFused(Layout):
    name = "mla_fused"
    family = "mla"
    shape = "(nb, bs, kv_lora_rank + rope_dim)"

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        (t,) = as_tuple(self, layer, value, (1,))
        kv_c, k_pe = layer.slot("kv_c"), layer.slot("k_pe")
        width = kv_c.head_dim + k_pe.head_dim
        expect_shape(self, layer, FUSED_SLOT, t, (None, tokens_per_block, width))
        return [SlotTensor(FUSED_SLOT, t, kv_c.dtype, 1, width)]

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        kv_c, k_pe = layer.slot("kv_c"), layer.slot("k_pe")
        shape = (num_blocks, tokens_per_block, kv_c.head_dim + k_pe.head_dim)
        return torch.zeros(shape, dtype=torch_dtype(kv_c.dtype), device=device)
