"""SGLang's own pools and storage config, built on CPU for the HiCache backend's tests.

SGLang's device pools (``MHATokenToKVPool``, ``MLATokenToKVPool`` in ``mem_cache/memory_pool.py``) allocate on
``device="cpu"``, and its host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` in
``mem_cache/pool_host/``) take the device pool's ``get_device_pool_infos()`` as SGLang's own ``HiCacheController``
passes them, so every pool here is SGLang's class built the way SGLang builds it; only ``pin_memory`` is off (no
CUDA to pin with). Page bytes are filled at random and read back with the pool's own ``get_data_page``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvplane.integrations.sglang import CLASS_NAME, MODULE_PATH

MiB = 1 << 20
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mha_host(layout: str, *, layers: int = 3, heads: int = 2, head_dim: int = 16, page: int = 4,
             tokens: int = 64, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=tokens, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim,
                              layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1)


def mla_host(layout: str, *, layers: int = 3, page: int = 4, tokens: int = 64,
             dtype: torch.dtype = torch.bfloat16) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(size=tokens, page_size=page, dtype=dtype, kv_lora_rank=32, qk_rope_head_dim=16,
                              layer_num=layers, device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1,
                                target_layer_num=layers)


def host(kind: str, layout: str, **geometry: Any) -> Any:
    return mha_host(layout, **geometry) if kind == "mha" else mla_host(layout, **geometry)


def fill(pool: Any, seed: int) -> None:
    """Random bytes in every slot of ``pool`` (distinct per page, with overwhelming odds)."""
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def page_bytes(pool: Any, first_slot: int) -> bytes:
    """The bytes of the page starting at ``first_slot``, read with SGLang's own ``get_data_page``."""
    return bytes(pool.get_data_page(first_slot, flat=True).contiguous().view(torch.uint8).numpy())


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    """The host indices of whole pages ``pages`` (page numbers), as SGLang passes them."""
    size = pool.page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size, dtype=torch.int64) for p in pages])


def page_hashes(count: int, seed: int = 0, page: int = 4) -> list[str]:
    """SGLang's own storage keys (its chained page hashes) for ``count`` pages of made-up tokens."""
    tokens = [seed * 100_000 + i for i in range(count * page)]
    return list(get_storage_hash_str(tokens, None, page_size=page))


def extra_config(master_address: str, **store: Any) -> dict[str, Any]:
    """The extra config as ``--hicache-storage-backend-extra-config`` would carry it (through JSON)."""
    raw = {"backend_name": "kvplane", "module_path": MODULE_PATH, "class_name": CLASS_NAME, "interface_v1": 1,
           "master_address": master_address, "segment_bytes": 32 * MiB, "local_buffer_bytes": 16 * MiB,
           "timeout_s": 5.0, **store}
    return dict(json.loads(json.dumps(raw)))


def storage_config(extra: dict[str, Any], *, model: str = "org/model-a", tp_size: int = 1, tp_rank: int = 0,
                   mla: bool = False, layout: str = "page_first") -> HiCacheStorageConfig:
    """``HiCacheStorageConfig`` as ``HiCacheController._generate_storage_config`` fills it for one rank."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config=dict(extra))
