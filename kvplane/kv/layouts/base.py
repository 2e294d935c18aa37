"""The layout-spec interface: how one engine on one device keeps a layer's slots in tensors.

A layout is data plus two small methods: ``regions`` (engine tensors -> Regions, validating shape, dtype and
strides up front) and ``allocate`` (empty tensors in this layout, for tests, the bench and the conformance
suite). A layout borrows the engine's tensors; it never copies or owns them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvplane.descriptors import Region
from kvplane.errors import LayoutError
from kvplane.kv.spec import LayerSpec

if TYPE_CHECKING:
    import torch

    LayerValue = torch.Tensor | tuple[torch.Tensor, ...]
else:
    LayerValue = object


@dataclass(frozen=True)
class SlotTensor:
    """A tensor holding one region: ``tensor[i]`` is block i of slot ``slot``."""

    slot: str
    tensor: torch.Tensor
    dtype: str
    heads: int
    head_elems: int


class Layout(ABC):
    """One tensor shape an engine uses for a layer's KV cache."""

    name: ClassVar[str]
    family: ClassVar[str]  # the spec family it stores: "gqa", "mla" or "index"
    shape: ClassVar[str]  # the shape, as engines document it, e.g. "(2, nb, bs, h, d)"
    order: ClassVar[str] = "NHD"

    @abstractmethod
    def slot_tensors(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[SlotTensor]:
        """One entry per region: the tensor whose dim 0 indexes blocks, validated against the layer spec."""

    def regions(self, layer: LayerSpec, tokens_per_block: int, value: LayerValue) -> list[Region]:
        """The regions of one layer's tensors, in ``slot_tensors`` order."""
        return [
            block_region(layer, st.slot, st.dtype, st.tensor, tokens_per_block, st.heads, st.head_elems, self.order)
            for st in self.slot_tensors(layer, tokens_per_block, value)
        ]

    @abstractmethod
    def allocate(
        self, layer: LayerSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str = "cpu"
    ) -> LayerValue:
        """Zeroed tensors for one layer in this layout."""

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


def expect_shape(layout: Layout, layer: LayerSpec, what: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """Check ``t.shape`` against ``shape`` (``None`` = any); the error names the layer, tensor and dim."""
    if t.dim() != len(shape):
        raise LayoutError(
            f"layer {layer.name!r} {what}: layout {layout.name} expects {layout.shape} "
            f"({len(shape)} dims), got shape {tuple(t.shape)}; pick the layout that matches the engine's cache"
        )
    for dim, (got, want) in enumerate(zip(t.shape, shape)):
        if want is not None and got != want:
            raise LayoutError(
                f"layer {layer.name!r} {what}: dim {dim} of {layout.shape} is {got}, the KV spec says {want}; "
                f"check heads/head_dim/tokens_per_block in the spec against the engine's cache"
            )


def block_region(
    layer: LayerSpec,
    slot: str,
    dtype: str,
    t: torch.Tensor,
    tokens_per_block: int,
    heads: int,
    head_elems: int,
    order: str = "NHD",
) -> Region:
    """A region for tensor ``t`` whose dim 0 indexes blocks and whose blocks are each contiguous."""
    if torch_dtype_name(t) != dtype:
        raise LayoutError(
            f"layer {layer.name!r} slot {slot!r}: tensor dtype is {torch_dtype_name(t)}, the KV spec says "
            f"{dtype}; build the spec with dtype={torch_dtype_name(t)!r}"
        )
    inner = t[0] if t.shape[0] > 0 else t
    if t.shape[0] == 0:
        raise LayoutError(f"layer {layer.name!r} slot {slot!r}: the cache has 0 blocks")
    if not inner.is_contiguous():
        raise LayoutError(
            f"layer {layer.name!r} slot {slot!r}: one block is not contiguous (strides {tuple(t.stride())}); "
            f"kvplane moves whole blocks, so each block must be one contiguous range"
        )
    itemsize = t.element_size()
    block_bytes = math.prod(t.shape[1:]) * itemsize
    block_stride = t.stride(0) * itemsize
    if block_stride < block_bytes:
        raise LayoutError(
            f"layer {layer.name!r} slot {slot!r}: block stride {block_stride} B is smaller than a block "
            f"({block_bytes} B), so blocks overlap"
        )
    return Region(
        group_id=layer.group_id,
        layer=layer.index,
        layer_name=layer.name,
        slot=slot,
        addr=t.data_ptr(),
        num_blocks=t.shape[0],
        block_stride=block_stride,
        block_bytes=block_bytes,
        tokens_per_block=tokens_per_block,
        heads=heads,
        head_bytes=head_elems * itemsize,
        order=order,
    )


def as_tuple(layout: Layout, layer: LayerSpec, value: LayerValue, counts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The layer's value as a tuple of tensors, checking how many the layout takes."""
    import torch

    items = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    if len(items) not in counts:
        raise LayoutError(
            f"layer {layer.name!r}: layout {layout.name} takes {' or '.join(map(str, counts))} tensor(s) "
            f"{layout.shape}, got {len(items)}"
        )
    return items
