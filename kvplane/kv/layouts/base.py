"""Layout specs: how an engine keeps one layer's slots in tensors, as data, read from each tensor's strides.

A layout names the logical dimensions of every tensor a layer hands over (``block``, ``token``, ``head``,
``row``, and ``kv`` where one dimension selects K or V) and which spec slots each row packs, in order. Reading
a tensor takes its real sizes, strides and ``data_ptr()`` (storage offset included), so NHD and HND memory, a
permuted view (vLLM hands connectors its memory-order buffer permuted to the logical shape) and one layer of a
cross-layer tensor come out right with the same arithmetic. One small file per shape names the engine that
allocates it; this module holds what they share. A layout borrows the engine's tensors; it never copies them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplane.descriptors import Region, SlotPart
from kvplane.errors import LayoutError
from kvplane.kv.spec import LayerSpec, SlotSpec

if TYPE_CHECKING:
    import torch

    LayerValue = torch.Tensor | tuple[torch.Tensor, ...]
else:
    LayerValue = object

DIMS = ("kv", "block", "token", "head", "row")
INNER = ("token", "head")
ORDERS = ("NHD", "HND")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layer: its logical dimensions and, per index of ``kv`` (one entry without it), the slots
    packed in each row. ``optional`` tensors are handed over only when the layer spec has their slots."""

    dims: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    optional: bool = False

    def __post_init__(self) -> None:
        unknown = [d for d in self.dims if d not in DIMS]
        if unknown or len(set(self.dims)) != len(self.dims) or not {"block", "token", "row"} <= set(self.dims):
            raise LayoutError(f"tensor dims {self.dims} must name block, token and row once each, from {DIMS}")
        if ("kv" in self.dims) != (len(self.rows) > 1):
            raise LayoutError(f"tensor dims {self.dims}: a kv dim needs one row entry per index, got {self.rows}")

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(name for row in self.rows for name in row)


@dataclass(frozen=True)
class SlotTensor:
    """One region's tensor as a canonical view ``(num_blocks, tokens, heads, row)``, whatever the memory order:
    ``tensor[i]`` is block i; ``parts`` place the spec slots inside a row (element offsets, element counts)."""

    slot: str
    tensor: torch.Tensor
    dtype: str
    heads: int
    row_elems: int
    parts: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class Layout:
    """One way an engine keeps a layer's KV cache, named after its shape (LMCache names its specs the same way)."""

    name: str
    family: str  # the spec family it stores: "gqa", "mla" or "index"
    shape: str  # as the engine documents it, e.g. "(nb, heads, bs, 2*head)"
    engine: str  # who allocates tensors of this shape
    tensors: tuple[TensorSpec, ...]

    def tensor_specs(self, layer: LayerSpec) -> tuple[TensorSpec, ...]:
        names = {s.name for s in layer.slots}
        return tuple(ts for ts in self.tensors if not ts.optional or set(ts.slots) <= names)

    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        """One canonical view per region, validated against the layer spec (``LayoutError`` otherwise)."""
        return [st for st, _ in self._read(layer, tokens_per_block, value)]

    def regions(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[Region]:
        """The regions of one layer's tensors, in ``slot_tensors`` order."""
        return [r for _, r in self._read(layer, tokens_per_block, value)]

    def _read(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[tuple[SlotTensor, Region]]:
        specs = self.tensor_specs(layer)
        tensors = as_tuple(self, layer, value, len(specs))
        return [pair for ts, t in zip(specs, tensors) for pair in read_tensor(self, layer, tokens_per_block, ts, t)]

    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu",
        order: str = "NHD",
    ) -> LayerValue:
        """Zeroed tensors for one layer, laid out in memory as ``order`` says and viewed in the logical shape."""
        out = tuple(
            allocate_tensor(ts, layer, num_blocks, tokens_per_block, device, order) for ts in self.tensor_specs(layer)
        )
        return out[0] if len(self.tensors) == 1 else out

    def __repr__(self) -> str:
        return f"<layout {self.name} {self.shape}>"


def torch_dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"dtype={name!r} is not a torch dtype")
    return dtype


def _names() -> list[str]:
    from kvplane.kv.layouts import LAYOUTS

    return sorted(LAYOUTS)


def as_tuple(layout: Layout, layer: LayerSpec, value: LayerValue, count: int) -> tuple[torch.Tensor, ...]:
    """The layer's value as a tuple of tensors, checking how many the layout takes."""
    import torch

    items = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    if len(items) != count or not all(isinstance(t, torch.Tensor) for t in items):
        raise LayoutError(
            f"layer {layer.name!r}: layout {layout.name} takes {count} tensor(s) {layout.shape}, got "
            f"{len(items)} ({', '.join(type(t).__name__ for t in items)}); pass what {layout.engine} allocates"
        )
    return items


def _row_slots(layer: LayerSpec, names: tuple[str, ...]) -> list[SlotSpec]:
    slots = [layer.slot(name) for name in names]
    if len({(s.heads, s.dtype) for s in slots}) != 1:
        raise LayoutError(
            f"layer {layer.name!r}: slots {list(names)} share a row, so they need one head count and dtype; "
            f"the spec has {[(s.name, s.heads, s.dtype) for s in slots]}"
        )
    return slots


def expected_sizes(ts: TensorSpec, layer: LayerSpec, tokens_per_block: int) -> dict[str, int]:
    """The size each dim must have (``block`` excepted) for this layer spec."""
    rows = [_row_slots(layer, names) for names in ts.rows]
    widths = {sum(s.head_dim for s in row) for row in rows}
    heads = {row[0].heads for row in rows}
    if len(widths) != 1 or len(heads) != 1:
        raise LayoutError(f"layer {layer.name!r}: the rows {ts.rows} differ in width or heads; the spec is inconsistent")
    sizes = {"token": tokens_per_block, "row": widths.pop(), "head": heads.pop(), "kv": len(ts.rows)}
    if "head" not in ts.dims and sizes["head"] != 1:
        raise LayoutError(f"layer {layer.name!r}: this tensor has no head dim but the spec has {sizes['head']} heads")
    return {d: sizes[d] for d in ts.dims if d != "block"}


def read_tensor(
    layout: Layout, layer: LayerSpec, tokens_per_block: int, ts: TensorSpec, t: torch.Tensor
) -> Iterator[tuple[SlotTensor, Region]]:
    """Regions of one tensor from its real strides; every check runs before anything is yielded."""
    where = f"layer {layer.name!r} slot {'+'.join(ts.slots)!r}"
    size, stride = _checked_dims(layout, layer, tokens_per_block, ts, t, where)
    rows = [_row_slots(layer, names) for names in ts.rows]
    dtype = rows[0][0].dtype
    if torch_dtype_name(t) != dtype:
        raise LayoutError(
            f"{where}: tensor dtype is {torch_dtype_name(t)}, the KV spec says {dtype}; build the spec with "
            f"dtype={torch_dtype_name(t)!r}"
        )
    block_elems = _dense_block(t, size, stride, where)
    heads, row, isz = size.get("head", 1), size["row"], t.element_size()
    order = "HND" if heads > 1 and tokens_per_block > 1 and stride["head"] > stride["token"] else "NHD"
    canonical = t.permute(*[ts.dims.index(d) for d in ("kv", "block", "token", "head", "row") if d in ts.dims])
    if "head" not in ts.dims:
        canonical = canonical.unsqueeze(-2)
    for i, slots in enumerate(rows):
        offsets = [sum(s.head_dim for s in slots[:j]) for j in range(len(slots))]
        parts = tuple((s.name, off, s.head_dim) for s, off in zip(slots, offsets))
        view = canonical[i] if "kv" in ts.dims else canonical
        name = "+".join(s.name for s in slots)
        region = Region(
            group_id=layer.group_id,
            layer=layer.index,
            layer_name=layer.name,
            addr=t.data_ptr() + i * stride.get("kv", 0) * isz,
            num_blocks=size["block"],
            block_stride=stride["block"] * isz if size["block"] > 1 else block_elems * isz,
            block_bytes=block_elems * isz,
            tokens_per_block=tokens_per_block,
            heads=heads,
            row_bytes=row * isz,
            parts=tuple(SlotPart(n, off * isz, w * isz) for n, off, w in parts),
            order=order,
        )
        yield SlotTensor(name, view, dtype, heads, row, parts), region


def _checked_dims(layout: Layout, layer: LayerSpec, tokens_per_block: int, ts: TensorSpec, t: torch.Tensor,
                  where: str) -> tuple[dict[str, int], dict[str, int]]:
    """The tensor's size and stride by dim name, once its dims match the layout and the KV spec."""
    if t.dim() != len(ts.dims):
        raise LayoutError(
            f"{where}: layout {layout.name} expects {layout.shape} ({len(ts.dims)} dims), got shape "
            f"{tuple(t.shape)}; the tensor is not this layout: name the layout ({', '.join(_names())}) that "
            f"matches the engine's cache, or let the connector read it from the engine's attention backend"
        )
    size, stride = dict(zip(ts.dims, t.shape)), dict(zip(ts.dims, t.stride()))
    for dim, want in expected_sizes(ts, layer, tokens_per_block).items():
        if size[dim] != want:
            raise LayoutError(
                f"{where}: dim {ts.dims.index(dim)} ({dim}) of {layout.shape} is {size[dim]}, the KV spec says "
                f"{want} (shape {tuple(t.shape)}); check heads, head size and block size in the spec against "
                f"the engine's cache"
            )
    if size["block"] < 1:
        raise LayoutError(f"{where}: the cache has 0 blocks")
    return size, stride


def _dense_block(t: torch.Tensor, size: dict[str, int], stride: dict[str, int], where: str) -> int:
    """Elements of one block, once each block is dense (rows, tokens and heads), blocks do not overlap and the
    view stays inside its storage."""
    if size["row"] > 1 and stride["row"] != 1:
        raise LayoutError(f"{where}: one block is not contiguous: rows are strided (strides {tuple(t.stride())}); "
                          f"kvplane moves whole blocks, so each (token, head) row must be contiguous")
    expect = size["row"]
    for st, sz in sorted((stride[d], size[d]) for d in INNER if d in size and size[d] > 1):
        if st != expect:
            raise LayoutError(
                f"{where}: one block is not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
                f"kvplane moves whole blocks, so tokens and heads of a block must be dense"
            )
        expect *= sz
    extent = expect
    for st, sz, dim in sorted((stride[d], size[d], d) for d in ("block", "kv") if d in size and size[d] > 1):
        if st < extent:
            raise LayoutError(
                f"{where}: dim {dim!r} has stride {st} elements but what it steps over spans {extent}, so "
                f"blocks overlap (strides {tuple(t.stride())}); pass the engine's tensor, not an expanded view"
            )
        extent += st * (sz - 1)
    if (t.storage_offset() + extent) * t.element_size() > t.untyped_storage().nbytes():
        raise LayoutError(f"{where}: the view reaches past the end of its storage; pass the engine's own tensor")
    return expect


def memory_dims(ts: TensorSpec, order: str) -> list[str]:
    """The dims of ``ts`` in memory order: outer dims as the logical shape has them, then tokens and heads as
    ``order`` says, then the row."""
    if order not in ORDERS:
        raise LayoutError(f"order={order!r} is unknown; use one of {ORDERS}")
    inner = ("token", "head") if order == "NHD" else ("head", "token")
    outer = [d for d in ts.dims if d in ("kv", "block")]
    return outer + [d for d in inner if d in ts.dims] + ["row"]


def allocate_tensor(
    ts: TensorSpec, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: object, order: str
) -> torch.Tensor:
    import torch

    sizes = {**expected_sizes(ts, layer, tokens_per_block), "block": num_blocks}
    mem = memory_dims(ts, order)
    dtype = torch_dtype(_row_slots(layer, ts.rows[0])[0].dtype)
    raw: torch.Tensor = torch.zeros([sizes[d] for d in mem], dtype=dtype, device=device)  # type: ignore[call-overload]
    logical: torch.Tensor = raw.permute(*[mem.index(d) for d in ts.dims])
    return logical
