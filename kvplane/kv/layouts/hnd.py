"""HND GQA (head-major blocks, as NIXL's heterogeneous-TP path wants): k and v, each ``(nb, h, bs, d)``.

Inside a block all tokens of head 0 come first, so one head's slice of a block is contiguous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch


class HND(Layout):
    name = "hnd"
    family = "gqa"
    shape = "k, v: (nb, h, bs, d)"
    order = "HND"

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        tensors = as_tuple(self, layer, value, (2,))
        out = []
        for name, t in zip(("k", "v"), tensors):
            s = layer.slot(name)
            expect_shape(self, layer, name, t, (None, s.heads, tokens_per_block, s.head_dim))
            out.append(SlotTensor(name, t, s.dtype, s.heads, s.head_dim))
        return out

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        return tuple(
            torch.zeros(
                (num_blocks, s.heads, tokens_per_block, s.head_dim), dtype=torch_dtype(s.dtype), device=device
            )
            for s in (layer.slot("k"), layer.slot("v"))
        )
