"""The ``HiCacheStorage`` SGLang constructs: HiCache's L3 pages in Mooncake Store through kvplane's store tier.

SGLang's ``StorageBackendFactory`` builds it for ``--hicache-storage-backend dynamic`` as
``KvplaneHiCacheStorage(storage_config, kwargs)`` (``mem_cache/storage/backend_factory.py``), then the cache
controller calls ``register_mem_pool_host`` with its host pool (and ``register_mem_host_pool_v2`` with every
side pool of a hybrid model), and from its prefetch and backup threads:

- ``batch_exists(keys)``: how many leading pages the store holds whole;
- ``batch_get_v1`` / ``batch_set_v1(keys, host_indices)``: pages straight into and out of the host pool, one bool
  per page (SGLang uses these only with ``"interface_v1": 1``, which the constructor requires);
- ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``: the same for each side pool (SWA, Mamba, indexer),
  under the hit policy SGLang names per pool (``hits.py``).

Keys follow ``keys.py``; host addresses are the host pool's own (``pages.py``); the calls go through
``PageStore`` (``page_store.py``), so a down or full store is a miss or a False, never an exception or a hang.
Pages of a pool every TP rank holds alike (MLA) are written by SGLang's storage writer rank only and read by all.
This is the only kvplane module that imports SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvplane.flows.offload.store import StoreTier
from kvplane.integrations.sglang.hits import longest, restorable
from kvplane.integrations.sglang.keys import Shard, key_prefix, page_keys, pool_format
from kvplane.integrations.sglang.page_store import PageStore
from kvplane.integrations.sglang.pages import HostPool, page_spans, part_bytes
from kvplane.integrations.sglang.settings import WHAT, HiCacheConfigError, parse_settings

logger = logging.getLogger("kvplane.sglang")
KV = str(PoolName.KV)


@dataclass(frozen=True)
class Pool:
    """A registered host pool: where its pages' keys start, how many parts a page has, whether ranks share it."""

    host: HostPool
    prefix: str
    parts: int
    replicated: bool


class KvplaneHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None, *,
                 tier: StoreTier | None = None) -> None:
        settings = parse_settings(storage_config.extra_config)
        self.config = storage_config
        self.shard = _shard(storage_config)
        self.namespace = settings.store.namespace
        self.pages = PageStore(tier if tier is not None else StoreTier(settings.store), settings.late_wait_s)
        self.registered_pools: dict[Any, Any] = {}
        self.pools: dict[str, Pool] = {}
        self._anchor_only = False  # the KV host pool is a logical anchor with no bytes (DeepSeek V4)
        self._closed = False

    # -- host pools ---------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            self._anchor_only = True  # its side pools carry the bytes, through the v2 calls
            return
        self._add_pool(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name in self.pools and self.pools[name].host is host_pool:
            return
        if not list(_host_buffers(host_pool)):
            return
        self._add_pool(name, host_pool)

    def _add_pool(self, name: str, host: Any) -> None:
        sizes = part_bytes(host)
        replicated = self._replicated(host)
        fmt = pool_format(str(host.layout), str(host.dtype), sizes)
        prefix = key_prefix(self.namespace, self.shard, replicated, name, fmt)
        self.pages.register(_host_buffers(host))
        self.pools[name] = Pool(host, prefix, len(sizes), replicated)
        logger.info("SGLang %s pool on the kvplane store tier: %d part(s) of %s B a page, keys %s<page hash>/<part>",
                    name, len(sizes), sorted(set(sizes)), prefix)

    def _replicated(self, host: Any) -> bool:
        """Whether every TP rank holds this pool's pages alike: an MLA model's pools but its head-sharded (MHA)
        and state-sharded (Mamba) ones."""
        if not self.config.is_mla_model:
            return False
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        return not isinstance(host, (MHATokenToKVPoolHost, MambaPoolHost))

    # -- v1: the KV pool ----------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the store holds whole (0 when it is down)."""
        pool = self.pools.get(KV)
        if pool is None:
            return len(keys) if self._anchor_only else 0
        return self.pages.leading(page_keys(pool.prefix, keys, pool.parts), pool.parts)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._move(KV, keys, host_indices, write=False)

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._move(KV, keys, host_indices, write=True)

    def _move(self, name: str, keys: list[str], host_indices: Any, write: bool) -> list[bool]:
        """Pages ``keys`` of pool ``name`` out of (``write``) or into the host slots ``host_indices``."""
        pool = self.pools.get(name)
        if pool is None:
            if name == KV and self._anchor_only:
                return [True] * len(keys)  # a logical anchor has no bytes of its own (SGLang's own convention)
            logger.error("SGLang asked for pool %r, which was never registered with the kvplane backend", name)
            return [False] * len(keys)
        if not keys:
            return []
        if write and pool.replicated and not self.config.is_storage_writer:
            return [True] * len(keys)  # the writer rank stores the pages every rank holds alike
        spans = page_spans(pool.host, host_indices, len(keys)) if host_indices is not None else "no host indices"
        if isinstance(spans, str) or spans.parts != pool.parts:
            why = spans if isinstance(spans, str) else f"{spans.parts} part(s) a page, registered {pool.parts}"
            logger.error("%s of %d %s page(s) refused: %s", "set" if write else "get", len(keys), name, why)
            return [False] * len(keys)
        stored = page_keys(pool.prefix, keys, pool.parts)
        return self.pages.put(stored, spans) if write else self.pages.get(stored, spans)

    # -- v2: every pool -----------------------------------------------------------------------------------
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        return {t.name: self._move(str(t.name), list(t.keys or []), t.host_indices, write=False) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        return {t.name: self._move(str(t.name), list(t.keys or []), t.host_indices, write=True) for t in transfers}

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable KV prefix when every side pool must restore it too, under each pool's hit policy."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        if not kv_pages:
            return PoolTransferResult(0, hits, [])
        usable = np.ones(kv_pages, dtype=bool)
        for transfer in pool_transfers or []:
            pool = self.pools.get(str(transfer.name))
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            if pool is None:
                logger.error("batch_exists_v2 names pool %r, never registered: reporting a miss", transfer.name)
                return PoolTransferResult(0, {}, [])
            found = self.pages.found(page_keys(pool.prefix, keys[:kv_pages], pool.parts), pool.parts)
            mask = restorable(policy, found, kv_pages, len(transfer.keys or []))
            if mask is None:
                logger.warning("hit policy %r of pool %r is not served by the kvplane backend: reporting a miss",
                               policy, transfer.name)
                return PoolTransferResult(0, {}, [])
            if longest(mask):
                hits[transfer.name] = longest(mask)
            usable &= mask
        lengths = (np.flatnonzero(usable) + 1).tolist()
        return PoolTransferResult(lengths[-1] if lengths else 0, hits, lengths)

    # -- the rest of the interface ------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_COPYING)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_COPYING)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError(_COPYING)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError(_COPYING)

    def clear(self) -> None:
        """Leaves the store as it is: other instances and deployments share it (objects age out in the master)."""
        logger.info("SGLang asked to clear HiCache storage; the kvplane backend keeps the shared store as it is")

    def close(self) -> None:
        """Close the store client (once: SGLang may close on a failed attach and again on detach)."""
        if not self._closed:
            self._closed = True
            self.pages.tier.close()


_COPYING = ("the kvplane backend moves pages zero-copy (batch_get_v1/batch_set_v1); SGLang calls the copying "
            "get/set only for a dynamic backend without \"interface_v1\": 1, which the constructor refuses")


def _shard(config: HiCacheStorageConfig) -> Shard:
    """The rank's place in the model, from SGLang's storage config; unsupported splits are refused here."""
    if not config.model_name:
        raise HiCacheConfigError(f"HiCacheStorageConfig.model_name={config.model_name!r}: the kvplane backend keys "
                                 f"pages by model; launch SGLang with --served-model-name")
    if config.dcp_size > 1 or config.should_split_heads:
        raise HiCacheConfigError(
            f"HiCacheStorageConfig dcp_size={config.dcp_size}, should_split_heads={config.should_split_heads}: "
            f"decode context parallelism and tp_lcm_size head splitting are not served by the kvplane backend; "
            f"drop them or the kvplane backend ({WHAT})")
    return Shard(model=config.model_name, tp_size=config.tp_size, tp_rank=config.tp_rank, pp_size=config.pp_size,
                 pp_rank=config.pp_rank, cp_size=config.attn_cp_size, cp_rank=config.attn_cp_rank)


def _host_buffers(host: Any) -> list[tuple[int, int]]:
    """The host memory of a pool, ``(start, nbytes)``: the buffers it lists for zero-copy registration."""
    tensors = host.get_hybrid_pool_buffer() if hasattr(host, "get_hybrid_pool_buffer") else [
        getattr(host, "kv_buffer", None)]
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return [(int(t.data_ptr()), int(t.numel() * t.element_size())) for t in tensors if t is not None]
