"""Layout specs, one small file per shape, and the registry that names them.

``get_layout("packed_kv")`` returns the spec; ``LAYOUTS`` lists them all. A backend names the layouts its
engines use in its attributes; the vLLM connector reads the layout from the attention backend's own shape
functions. The core never chooses a layout by device.
"""

from __future__ import annotations

from kvplane.errors import LayoutError
from kvplane.kv.layouts.base import LayerValue, Layout, SlotTensor, TensorSpec
from kvplane.kv.layouts.block_kv import BLOCK_KV
from kvplane.kv.layouts.index import INDEX
from kvplane.kv.layouts.kv_first import KV_FIRST
from kvplane.kv.layouts.mla_fused import FUSED_SLOT, MLA_FUSED
from kvplane.kv.layouts.mla_heads import MLA_HEADS
from kvplane.kv.layouts.mla_split import MLA_SPLIT
from kvplane.kv.layouts.packed_kv import PACKED_KV
from kvplane.kv.layouts.split_kv import SPLIT_KV

LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (PACKED_KV, KV_FIRST, BLOCK_KV, MLA_FUSED, MLA_HEADS, SPLIT_KV, MLA_SPLIT, INDEX)
}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"layout={name!r} is unknown; use one of {sorted(LAYOUTS)}") from None


__all__ = ["FUSED_SLOT", "LAYOUTS", "LayerValue", "Layout", "SlotTensor", "TensorSpec", "get_layout"]
