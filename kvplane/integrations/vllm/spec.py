"""vLLM's ``KVCacheConfig`` (+ the tensors ``register_kv_caches`` hands over) -> a kvplane ``KVSpec``.

Each vLLM KV-cache group becomes a kvplane group with the same index and block size; each registered layer keeps
vLLM's name and order. Attention specs are read by attribute (``block_size``, ``num_kv_heads``, ``head_size``,
``dtype``), so no vLLM import is needed; MLA specs (``MLAAttentionSpec``, ``head_size`` = kv_lora_rank + rope
dim) become ``kv_c`` + ``k_pe`` slots. Specs without attention KV (Mamba state) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.integrations.vllm.config import ConnectorConfigError
from kvplane.kv.spec import KVGroup, KVSpec, LayerSpec, SlotSpec

DEFAULT_ROPE_DIM = 64  # DeepSeek's qk_rope_head_dim


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _slots(group_spec: Any, kv_lora_rank: int | None) -> tuple[SlotSpec, ...]:
    kind = type(group_spec).__name__
    heads, head_size = getattr(group_spec, "num_kv_heads", None), getattr(group_spec, "head_size", None)
    if heads is None or head_size is None:
        raise ConnectorConfigError(
            f"KV-cache group spec {kind} holds no attention KV (num_kv_heads/head_size); kvplane moves attention "
            f"KV only: run this model without the kvplane connector"
        )
    dtype = _dtype_name(group_spec.dtype)
    if "MLA" in kind:
        lora = kv_lora_rank if kv_lora_rank is not None else head_size - DEFAULT_ROPE_DIM
        if not 0 < lora < head_size:
            raise ConnectorConfigError(f"{kind}: kv_lora_rank={lora} must lie in (0, head_size={head_size})")
        return (SlotSpec("kv_c", 1, lora, dtype), SlotSpec("k_pe", 1, head_size - lora, dtype))
    head_size_v = getattr(group_spec, "head_size_v", None) or head_size
    if head_size_v != head_size:
        raise ConnectorConfigError(f"{kind}: head_size={head_size} != head_size_v={head_size_v} is not supported")
    return (SlotSpec("k", heads, head_size, dtype), SlotSpec("v", heads, head_size, dtype))


def spec_from_vllm(
    kv_cache_config: Any, layer_names: Sequence[str], *, kv_lora_rank: int | None = None
) -> KVSpec:
    """The kvplane spec of the layers ``layer_names`` (vLLM's registration order) under ``kv_cache_config``."""
    groups = list(kv_cache_config.kv_cache_groups)
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        for name in group.layer_names:
            group_of.setdefault(name, g)
    missing = [n for n in layer_names if n not in group_of]
    if missing:
        raise ConnectorConfigError(
            f"KV caches were registered for layers {missing[:3]} that no KV-cache group names; register the "
            f"tensors of this KVCacheConfig"
        )
    used = sorted({group_of[n] for n in layer_names})
    kv_groups = tuple(KVGroup(g, int(groups[g].kv_cache_spec.block_size)) for g in used)
    slots = {g: _slots(groups[g].kv_cache_spec, kv_lora_rank) for g in used}
    layers = tuple(LayerSpec(name, i, group_of[name], slots[group_of[name]]) for i, name in enumerate(layer_names))
    return KVSpec(groups=kv_groups, layers=layers)


def layouts_for(default: Mapping[str, str], override: Mapping[str, str] | None) -> dict[str, str]:
    """The backend's layouts per family, with the config's ``layouts`` on top."""
    return {**default, **(override or {})}
