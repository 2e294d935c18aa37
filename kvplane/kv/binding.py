"""From engine tensors to regions: binds a KV spec and layout specs to the tensors an engine registered.

Input is what vLLM's ``register_kv_caches`` hands over: ``{layer_name: Tensor | tuple[Tensor, ...]}``.
Every spec layer must be present and no unknown layer may appear; each layer is read through the layout of
its family. The result borrows the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvplane.descriptors import Region
from kvplane.errors import LayoutError
from kvplane.kv.layouts import LayerValue, Layout, get_layout
from kvplane.kv.layouts.base import SlotTensor
from kvplane.kv.spec import KVSpec

if TYPE_CHECKING:
    import torch

LayoutChoice = Layout | str | Mapping[str, Layout | str]


def layouts_by_family(choice: LayoutChoice) -> dict[str, Layout]:
    """Normalise a layout choice to ``{family: Layout}``; one layout alone serves its own family."""
    if isinstance(choice, (Layout, str)):
        layout = get_layout(choice) if isinstance(choice, str) else choice
        return {layout.family: layout}
    out = {}
    for family, item in choice.items():
        layout = get_layout(item) if isinstance(item, str) else item
        if layout.family != family:
            raise LayoutError(f"layout {layout.name} stores family {layout.family!r}, not {family!r}")
        out[family] = layout
    return out


def _layout_of(spec: KVSpec, by_family: dict[str, Layout], layer_name: str) -> Layout:
    layer = spec.layer(layer_name)
    layout = by_family.get(layer.family)
    if layout is None:
        raise LayoutError(
            f"layer {layer.name!r} is family {layer.family!r} but no layout was given for it; "
            f"pass one of the {layer.family} layouts"
        )
    return layout


def slot_tensors(spec: KVSpec, tensors: Mapping[str, LayerValue], layouts: LayoutChoice) -> list[SlotTensor]:
    """Every region's tensor (dim 0 = blocks), in spec layer order; validates shapes and names."""
    by_family = layouts_by_family(layouts)
    unknown = sorted(set(tensors) - set(spec.layer_names))
    if unknown:
        raise LayoutError(f"tensors for layers {unknown[:3]} are not in the KV spec; build the spec from the same model")
    out: list[SlotTensor] = []
    for layer in spec.layers:
        if layer.name not in tensors:
            raise LayoutError(f"layer {layer.name!r} has no tensor; register every layer of the KV spec")
        layout = _layout_of(spec, by_family, layer.name)
        tokens_per_block = spec.group(layer.group_id).tokens_per_block
        found = layout.slot_tensors(layer, tokens_per_block, tensors[layer.name])
        covered = {name for st in found for name in st.slot.split("+")}
        missing = [s.name for s in layer.slots if s.name not in covered]
        if missing:  # a slot no region holds would silently drop out of every manifest and transfer
            raise LayoutError(
                f"layer {layer.name!r}: layout {layout.name} has no place for slot(s) {missing}; use a layout that "
                f"stores them (e.g. mla_split with an index tensor, or the index layout for a separate layer)"
            )
        out.extend(found)
    return out


def regions_from_tensors(
    spec: KVSpec, tensors: Mapping[str, LayerValue], layouts: LayoutChoice
) -> list[Region]:
    """Every region of the given tensors, in spec layer order, slots in layout order."""
    by_family = layouts_by_family(layouts)
    slot_tensors(spec, tensors, by_family)  # validates names and shapes once, with the clearer messages
    regions: list[Region] = []
    for layer in spec.layers:
        layout = _layout_of(spec, by_family, layer.name)
        tokens_per_block = spec.group(layer.group_id).tokens_per_block
        regions.extend(layout.regions(layer, tokens_per_block, tensors[layer.name]))
    return regions


def allocate_cache(
    spec: KVSpec,
    layouts: LayoutChoice,
    num_blocks: int,
    device: object = "cpu",
    alloc: Callable[[int], torch.Tensor] | None = None,
    zero: bool = True,
) -> dict[str, LayerValue]:
    """Zeroed engine-style tensors for every layer of ``spec`` (tests, the bench, the conformance suite).

    With ``alloc`` (``nbytes -> uint8 tensor``, e.g. a backend's pinned ``alloc_host``) every tensor is carved
    out of one allocation instead; ``zero=False`` keeps what that memory holds.
    """
    import torch

    by_family = layouts_by_family(layouts)
    target = "meta" if alloc is not None else device
    out: dict[str, LayerValue] = {}
    for layer in spec.layers:
        layout = _layout_of(spec, by_family, layer.name)
        tokens_per_block = spec.group(layer.group_id).tokens_per_block
        out[layer.name] = layout.allocate(layer, num_blocks, tokens_per_block, target)  # type: ignore[arg-type]
    if alloc is None:
        return out
    flat = [(name, t) for name, v in out.items() for t in ((v,) if isinstance(v, torch.Tensor) else v)]
    total = sum(t.numel() * t.element_size() for _, t in flat)
    buf = alloc(total)
    if zero:
        buf.zero_()
    offset, carved = 0, dict[str, list[torch.Tensor]]()
    for name, t in flat:
        n = t.numel() * t.element_size()
        carved.setdefault(name, []).append(buf[offset : offset + n].view(t.dtype).view(t.shape))
        offset += n
    return {name: ts[0] if isinstance(out[name], torch.Tensor) else tuple(ts) for name, ts in carved.items()}
