"""The KV spec: what a model stores per token, independent of how an engine lays it out in memory.

A spec has KV-cache groups (``group_id`` -> tokens per block; hybrid models have several, e.g. full attention
and sliding window) and layers, each in one group, each with named slots: ``k``/``v`` for GQA and MHA,
``kv_c``/``k_pe`` for DeepSeek MLA, ``index`` for a sparse-attention indexer. Layout specs (``kv.layouts``) say
where those slots live in engine tensors. Pure data: no torch, no device.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvplane.errors import SpecError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

SLOT_NAMES = ("k", "v", "kv_c", "k_pe", "index")
FAMILY_SLOTS: dict[str, frozenset[str]] = {
    "gqa": frozenset({"k", "v"}),
    "mla": frozenset({"kv_c", "k_pe"}),
    "index": frozenset({"index"}),
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as torch names it (``"bfloat16"``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise SpecError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}") from None


class SlotSpec(msgspec.Struct, frozen=True):
    """One slot of a layer: ``heads`` x ``head_dim`` elements of ``dtype`` per token (MLA slots: 1 head)."""

    name: str
    heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.name not in SLOT_NAMES:
            raise SpecError(f"slot name={self.name!r} is unknown; use one of {SLOT_NAMES}")
        if self.heads < 1 or self.head_dim < 1:
            raise SpecError(f"slot {self.name!r}: heads={self.heads}, head_dim={self.head_dim} must be >= 1")
        if self.name in FAMILY_SLOTS["mla"] and self.heads != 1:
            raise SpecError(f"slot {self.name!r}: MLA slots have 1 head (replicated on every rank), got heads={self.heads}")
        dtype_bytes(self.dtype)

    @property
    def head_bytes(self) -> int:
        return self.head_dim * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.heads * self.head_bytes


class LayerSpec(msgspec.Struct, frozen=True):
    """One attention layer: its engine name, position, KV-cache group and slots."""

    name: str
    index: int
    group_id: int
    slots: tuple[SlotSpec, ...]

    @property
    def family(self) -> str:
        names = frozenset(s.name for s in self.slots)
        for family, needed in FAMILY_SLOTS.items():
            if needed <= names:
                return family
        raise SpecError(f"layer {self.name!r} has slots {sorted(names)}, which form no known family")

    def slot(self, name: str) -> SlotSpec:
        for s in self.slots:
            if s.name == name:
                return s
        raise SpecError(f"layer {self.name!r} has no slot {name!r}; it has {[s.name for s in self.slots]}")

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.slots)


class KVGroup(msgspec.Struct, frozen=True):
    """A KV-cache group: layers sharing one block table and block size."""

    group_id: int
    tokens_per_block: int


class KVSpec(msgspec.Struct, frozen=True):
    """Everything a model stores in its paged KV cache, per rank."""

    groups: tuple[KVGroup, ...]
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise SpecError("a KV spec needs at least one layer")
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise SpecError(f"group ids {ids} repeat; each KV-cache group needs its own id")
        for g in self.groups:
            if g.group_id < 0:
                raise SpecError(f"group_id={g.group_id} must be >= 0 (KV-cache group ids count from 0)")
            if g.tokens_per_block < 1:
                raise SpecError(f"group {g.group_id}: tokens_per_block={g.tokens_per_block} must be >= 1")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise SpecError("layer names repeat; every layer needs a unique name")
        for layer in self.layers:
            if layer.group_id not in ids:
                raise SpecError(f"layer {layer.name!r}: group_id={layer.group_id} is not one of {ids}")

    def group(self, group_id: int) -> KVGroup:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise SpecError(f"group_id={group_id} is unknown; this spec has {[g.group_id for g in self.groups]}")

    def layer(self, name: str) -> LayerSpec:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise SpecError(f"layer name={name!r} is not in this spec (first names: {self.layer_names[:3]})")

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    @classmethod
    def gqa(
        cls,
        num_layers: int,
        heads: int,
        head_dim: int,
        *,
        dtype: str = "bfloat16",
        tokens_per_block: int = 16,
        layer_groups: Sequence[int] | None = None,
        group_tokens_per_block: dict[int, int] | None = None,
        name_format: str = "layers.{}",
    ) -> KVSpec:
        """A GQA/MHA model: ``k`` and ``v`` slots of ``heads`` x ``head_dim`` in every layer.

        ``layer_groups[i]`` puts layer i in a group (hybrid models); by default all layers are group 0.
        """
        slots = (SlotSpec("k", heads, head_dim, dtype), SlotSpec("v", heads, head_dim, dtype))
        return cls._build(num_layers, slots, tokens_per_block, layer_groups, group_tokens_per_block, name_format)

    @classmethod
    def mla(
        cls,
        num_layers: int,
        *,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype: str = "bfloat16",
        tokens_per_block: int = 16,
        name_format: str = "layers.{}",
    ) -> KVSpec:
        """A DeepSeek MLA model: compressed ``kv_c`` (kv_lora_rank) and ``k_pe`` (rope dim), one head each."""
        slots = (SlotSpec("kv_c", 1, kv_lora_rank, dtype), SlotSpec("k_pe", 1, rope_dim, dtype))
        return cls._build(num_layers, slots, tokens_per_block, None, None, name_format)

    @classmethod
    def _build(
        cls,
        num_layers: int,
        slots: tuple[SlotSpec, ...],
        tokens_per_block: int,
        layer_groups: Sequence[int] | None,
        group_tokens_per_block: dict[int, int] | None,
        name_format: str,
    ) -> KVSpec:
        if num_layers < 1:
            raise SpecError(f"num_layers={num_layers} must be >= 1")
        groups_of = list(layer_groups) if layer_groups is not None else [0] * num_layers
        if len(groups_of) != num_layers:
            raise SpecError(f"layer_groups has {len(groups_of)} entries for num_layers={num_layers}")
        sizes = group_tokens_per_block or {}
        groups = tuple(KVGroup(g, sizes.get(g, tokens_per_block)) for g in sorted(set(groups_of)))
        layers = tuple(
            LayerSpec(name_format.format(i), i, groups_of[i], slots) for i in range(num_layers)
        )
        return cls(groups=groups, layers=layers)
