"""``BoundKV``: one rank's KV cache bound to the backend that moves it, checked once.

The engine's tensors (as vLLM's ``register_kv_caches`` hands them over, borrowed), the spec they follow, the
layout each family is read through, and the regions those give. ``bind`` checks the tensors against the spec
and layouts once; the offload engine, both P/D sides and their local KV take the bound value instead of four
loose arguments each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvplane.backend.base import Backend
from kvplane.descriptors import Region
from kvplane.kv.binding import LayoutChoice, layouts_by_family, regions_from_tensors
from kvplane.kv.layouts import LayerValue, Layout
from kvplane.kv.spec import KVSpec


@dataclass(frozen=True)
class BoundKV:
    backend: Backend
    spec: KVSpec
    caches: Mapping[str, LayerValue]  # borrowed: the regions point into these tensors
    layouts: Mapping[str, Layout]  # by family
    regions: tuple[Region, ...]  # in spec layer order, slots in layout order


def bind(backend: Backend, spec: KVSpec, caches: Mapping[str, LayerValue], layouts: LayoutChoice | None = None
         ) -> BoundKV:
    """Bind ``caches`` (read through ``layouts``, the backend's own when None) to ``backend`` and ``spec``;
    raises ``LayoutError`` naming the layer when a tensor does not fit."""
    by_family = layouts_by_family(layouts if layouts is not None else backend.layouts)
    return BoundKV(backend, spec, caches, by_family, tuple(regions_from_tensors(spec, caches, by_family)))
