"""vllm-ascend MLA: nope ``(nb, bs, 1, kv_lora_rank)`` and rope ``(nb, bs, 1, rope_dim)`` tensors per layer.

Sparse models (DeepSeek V3.2 on Ascend) pass a third tensor, the indexer keys ``(nb, bs, 1, index_dim)``,
which becomes the ``index`` slot when the layer spec has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.errors import LayoutError
from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, as_tuple, expect_shape, torch_dtype
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch


class MlaSplit(Layout):
    name = "mla_split"
    family = "mla"
    shape = "nope: (nb, bs, 1, kv_lora_rank), rope: (nb, bs, 1, rope_dim)[, index: (nb, bs, 1, index_dim)]"

    def _slot_names(self, layer: LayerSpec) -> tuple[str, ...]:
        has_index = any(s.name == "index" for s in layer.slots)
        return ("kv_c", "k_pe", "index") if has_index else ("kv_c", "k_pe")

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        names = self._slot_names(layer)
        tensors = as_tuple(self, layer, value, (len(names),))
        out = []
        for name, t in zip(names, tensors):
            s = layer.slot(name)
            if s.heads != 1:
                raise LayoutError(f"layer {layer.name!r} slot {name!r}: MLA slots have 1 head, spec says {s.heads}")
            expect_shape(self, layer, name, t, (None, tokens_per_block, 1, s.head_dim))
            out.append(SlotTensor(name, t, s.dtype, 1, s.head_dim))
        return out

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        import torch

        slots = [layer.slot(n) for n in self._slot_names(layer)]
        return tuple(
            torch.zeros((num_blocks, tokens_per_block, 1, s.head_dim), dtype=torch_dtype(s.dtype), device=device)
            for s in slots
        )
