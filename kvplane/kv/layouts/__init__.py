"""Layout specs, one small file per shape, and the registry that names them.

``get_layout("mla_split")`` returns the spec; ``LAYOUTS`` lists them all. A backend names the layouts its
engines use in its attributes; the core never chooses a layout by device.
"""

from __future__ import annotations

from kvplane.errors import LayoutError
from kvplane.kv.layouts.base import LayerValue, Layout
from kvplane.kv.layouts.gqa_fused import GqaFused
from kvplane.kv.layouts.hnd import HND
from kvplane.kv.layouts.index import IndexSlot
from kvplane.kv.layouts.mla_fused import FUSED_SLOT, MlaFused
from kvplane.kv.layouts.mla_split import MlaSplit
from kvplane.kv.layouts.split_kv import SplitKV

LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (GqaFused(), SplitKV(), HND(), MlaFused(), MlaSplit(), IndexSlot())
}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"layout={name!r} is unknown; use one of {sorted(LAYOUTS)}") from None


__all__ = ["FUSED_SLOT", "LAYOUTS", "Layout", "LayerValue", "get_layout"]
