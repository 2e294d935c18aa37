"""From engine tensors to regions: binds a KV spec and layout specs to the tensors an engine registered.

Input is what vLLM's ``register_kv_caches`` hands over: ``{layer_name: Tensor | tuple[Tensor, ...]}``.
Every spec layer must be present and no unknown layer may appear; each layer is read through the layout of
its family. The result borrows the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvplane.descriptors import Region
from kvplane.errors import LayoutError
from kvplane.kv.layouts import LAYOUTS, LayerValue, Layout, get_layout
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


def matching_layouts(spec: KVSpec, layer_name: str, value: LayerValue) -> list[Layout]:
    """Every registered layout of the layer's family that reads ``value`` without error (engines whose shape
    function is not at hand: the tensor's own shape and strides decide)."""
    layer = spec.layer(layer_name)
    tokens_per_block = spec.group(layer.group_id).tokens_per_block
    found = []
    for layout in LAYOUTS.values():
        if layout.family != layer.family:
            continue
        try:
            layout.slot_tensors(layer, tokens_per_block, value)
        except LayoutError:
            continue
        found.append(layout)
    return found


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


def token_rows(spec: KVSpec, tensors: Mapping[str, LayerValue], layouts: LayoutChoice,
               block_ids: Mapping[int, Sequence[int]], tokens: int) -> dict[tuple[str, str], torch.Tensor]:
    """Per ``(layer, slot)``, in spec order, the first ``tokens`` tokens of the blocks ``block_ids`` (per KV-cache
    group) as ``(tokens, heads, dim)``: the same values whatever the layout, memory order and block size (K and V in
    one row or apart, fused or split MLA), so two caches of different engines compare slot by slot."""
    import torch

    by_family = layouts_by_family(layouts)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for layer in spec.layers:
        index = torch.as_tensor(list(block_ids[layer.group_id]), dtype=torch.int64)
        per_block = spec.group(layer.group_id).tokens_per_block
        parts = {}
        for st in _layout_of(spec, by_family, layer.name).slot_tensors(layer, per_block, tensors[layer.name]):
            rows = st.tensor.index_select(0, index.to(st.tensor.device)).reshape(-1, st.heads, st.row_elems)[:tokens]
            parts.update({name: rows[..., offset : offset + width] for name, offset, width in st.parts})
        out.update({(layer.name, slot.name): parts[slot.name] for slot in layer.slots})
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
    order: str = "NHD",
) -> dict[str, LayerValue]:
    """Zeroed engine-style tensors for every layer of ``spec`` (tests, the bench, the conformance suite).

    Each tensor is laid out in memory as ``order`` says (``NHD`` or ``HND``) and viewed in its layout's logical
    shape, as vLLM does. With ``alloc`` (``nbytes -> uint8 tensor``, e.g. a backend's pinned ``alloc_host``)
    every tensor is carved out of one allocation instead; ``zero=False`` keeps what that memory holds.
    """
    import torch

    by_family = layouts_by_family(layouts)
    out: dict[str, LayerValue] = {}
    for layer in spec.layers:
        layout = _layout_of(spec, by_family, layer.name)
        tokens_per_block = spec.group(layer.group_id).tokens_per_block
        target = "meta" if alloc is not None else device
        out[layer.name] = layout.allocate(layer, num_blocks, tokens_per_block, target, order)  # type: ignore[arg-type]
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
        carved.setdefault(name, []).append(_carve(buf[offset : offset + n], t))
        offset += n
    return {name: ts[0] if isinstance(out[name], torch.Tensor) else tuple(ts) for name, ts in carved.items()}


def _carve(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw`` bytes viewed with ``like``'s shape and strides (``like`` is a dense, possibly permuted, view)."""
    return raw.view(like.dtype).as_strided(like.shape, like.stride())


def allocate_cross_layer(
    spec: KVSpec, layout: Layout | str, num_blocks: int, device: object = "cpu", zero: bool = True
) -> tuple[torch.Tensor, dict[str, LayerValue]]:
    """One tensor for every layer, as vLLM allocates it for a connector that prefers cross-layer blocks.

    Memory is ``(nb, num_layers, <one layer's NHD block>)``, so block ``i`` of every layer is one contiguous
    range. Returns that tensor (memory order, as vLLM passes it to ``register_cross_layers_kv_cache``) and the
    per-layer logical views. ``zero=False`` leaves the memory untouched (address space only, until written).
    """
    import torch

    layout = get_layout(layout) if isinstance(layout, str) else layout
    groups = {layer.group_id for layer in spec.layers}
    if (len(groups) != 1 or len(layout.tensors) != 1 or layout.tensors[0].dims[0] != "block"
            or len({layer.slots for layer in spec.layers}) != 1):
        raise LayoutError(
            f"cross-layer blocks need one KV-cache group of identical layers in a one-tensor layout whose blocks come "
            f"first; got groups {sorted(groups)} and layout {layout.name} {layout.shape}"
        )
    first = spec.layers[0]
    one = layout.allocate(first, 1, spec.group(first.group_id).tokens_per_block, "meta", "NHD")
    assert isinstance(one, torch.Tensor)
    num_layers = len(spec.layers)
    per_block = one.numel()
    make = torch.zeros if zero else torch.empty
    cross = make((num_blocks, num_layers, per_block), dtype=one.dtype, device=device)  # type: ignore[call-overload]
    views: dict[str, LayerValue] = {}
    for i, layer in enumerate(spec.layers):
        strides = [s if d != 0 else num_layers * per_block for d, s in enumerate(one.stride())]
        shape = (num_blocks, *one.shape[1:])
        views[layer.name] = cross[:, i].as_strided(shape, strides, cross.storage_offset() + i * per_block)
    return cross, views


def check_whole_allocations(tensors: Mapping[str, LayerValue], slack: int = 0) -> None:
    """Raise ``LayoutError`` unless the tensors, together, cover every storage they live in.

    An engine registers its whole cache; a slice of blocks (or a view shifted by some blocks) would register less
    than the engine indexes, or index it wrongly. Tensors sharing one allocation (vLLM's hybrid groups, vLLM
    0.33's one buffer for every layer, K and V halves of one buffer) are checked together. Gaps under ``slack``
    bytes pass: vllm-ascend over-allocates by 2 MiB and slices an aligned view out (the backend's registration
    alignment).
    """
    import torch

    covered: dict[int, list[tuple[int, int, str]]] = {}
    size_of: dict[int, int] = {}
    for name, value in tensors.items():
        for t in (value,) if isinstance(value, torch.Tensor) else value:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            size_of[key] = storage.nbytes()
            start = t.data_ptr() - key
            # the footprint of the outermost step (a tensor's blocks, padding included) counts as covered
            extent = max((n * st for n, st in zip(t.shape, t.stride())), default=1) * t.element_size()
            covered.setdefault(key, []).append((start, start + extent, name))
    for key, spans in covered.items():
        spans.sort()
        edge, gap = 0, None
        for start, end, _ in spans:
            if start - edge >= max(slack, 1) and gap is None:
                gap = (edge, start)
            edge = max(edge, end)
        if size_of[key] - edge >= max(slack, 1) and gap is None:
            gap = (edge, size_of[key])
        if gap is not None:
            names = sorted({n for _, _, n in spans})
            raise LayoutError(
                f"layers {names[:3]}: their tensors leave bytes [{gap[0]}, {gap[1]}) of their "
                f"{size_of[key]}-byte allocation uncovered; register the whole cache tensors the engine "
                f"allocated, not a slice of blocks or a part of them"
            )
