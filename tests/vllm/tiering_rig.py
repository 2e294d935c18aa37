"""vLLM's own native offloading with kvplane's store tier as its secondary tier, built as vLLM builds it.

``TieredInstance`` makes a real ``VllmConfig`` whose connector is vLLM's ``OffloadingConnector`` with
``TieringOffloadingSpec`` and ``KVPlaneStoreTier`` in ``secondary_tiers``, turns it into vLLM's
``OffloadingConfig`` with vLLM's ``build_offloading_config``, and has vLLM's ``OffloadingSpecFactory`` make the
spec and the spec make its ``TieringOffloadingManager`` (the primary CPU tier over vLLM's shared-memory region,
the tier through vLLM's ``SecondaryTierFactory``). The tests then call the manager as vLLM's scheduler-side
connector does: ``prepare_store``/``complete_store`` after a GPU -> CPU copy (played here by writing the primary
slots), ``lookup`` each step until a promotion from the store lands, ``on_schedule_end`` once per step. Keys are
vLLM's: ``hash_block_tokens`` over a prompt's blocks, ``make_offload_key``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import numpy as np
import torch
from realsched import BLOCK, LAYERS
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.kv_cache_interface import FullAttentionSpec

try:  # vLLM 0.33 moved the planner out of kv_cache_utils and plans the groups of all workers first
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    get_global_kv_cache_groups = None
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

HEADS, HEAD_DIM = 2, 8
PAGE = 2 * BLOCK * HEADS * HEAD_DIM * 4  # one layer's K and V of one block, float32


def tier_entry(master_address: str, **store: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry a user writes (docs/engines.md)."""
    return {"type": "KVPlaneStoreTier", "module_path": "kvplane.integrations.vllm_tier",
            "store": {"master_address": master_address, "segment_bytes": 32 << 20,
                      "local_buffer_bytes": 16 << 20, **store}}


def block_keys(tokens: list[int]) -> list[OffloadKey]:
    """vLLM's offload keys of a prompt's full blocks (group 0)."""
    keys, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[start:start + BLOCK])
        keys.append(make_offload_key(parent, 0))
    return keys


def content(key: OffloadKey, nbytes: int) -> np.ndarray:
    """Bytes that only ``key`` has: what the GPU -> CPU copy of that block wrote."""
    seed = np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8)
    return np.resize(seed, nbytes) ^ np.arange(nbytes, dtype=np.uint8)


class TieredInstance:
    """One vLLM instance's scheduler-side offloading: vLLM's manager, primary tier, and kvplane's store tier."""

    def __init__(self, model_dir: str, tier: dict[str, Any], *, cpu_blocks: int = 32, num_blocks: int = 80,
                 events: bool = True, head_dim: int = HEAD_DIM, pause_s: float = 0.005) -> None:
        """``head_dim`` sizes a block (the bench uses big ones); ``pause_s``: the wait between polled steps."""
        page = PAGE * head_dim // HEAD_DIM
        self.pause_s = pause_s
        load_general_plugins()  # as each vLLM process does: kvplane's plugin registers the tier type (0.27.1)
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_blocks * page * len(LAYERS),
                 "secondary_tiers": [tier]}
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    kv_connector_extra_config=extra, engine_id=f"tier-{uuid.uuid4().hex[:8]}")
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                                     max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                             enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null"),
        )
        if hasattr(config.cache_config, "kv_cache_layout"):  # 0.33: the engine core resolves it before planning
            config.cache_config.kv_cache_layout = "NHD"
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=head_dim, dtype=torch.float32)
        # vLLM's own planner lays the caches out (KVCacheTensor differs between the versions)
        specs = [dict.fromkeys(LAYERS, spec)]
        planned = (specs, [num_blocks * page * len(LAYERS)])
        [kv_cache_config] = (get_kv_cache_configs(config, *planned) if get_global_kv_cache_groups is None else
                             get_kv_cache_configs(config, *planned, get_global_kv_cache_groups(config, specs)))
        self.spec = OffloadingSpecFactory.create_spec(build_offloading_config(config, kv_cache_config))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.view = np.asarray(self.manager.primary_tier.get_kv_memoryview())  # (slots, slot bytes), shared
        self.events: list[Any] = []
        self._n = 0

    def step(self) -> None:
        """The end of one scheduler step (vLLM's connector calls it from ``build_connector_meta``)."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self.events.extend(self.manager.take_events())

    def open_request(self) -> ReqContext:
        self._n += 1
        req = ReqContext(req_id=f"r{self._n}")
        self.manager.on_new_request(req)
        return req

    def close_request(self, req: ReqContext) -> None:
        self.manager.on_request_finished(req)
        self.step()

    def events_of_tier(self) -> list[Any]:
        """The events kvplane's tier announced (medium CPU, REMOTE): the primary tier's are LOCAL or unset."""
        return [e for e in self.events if e.locality is Locality.REMOTE]

    def store(self, keys: list[OffloadKey], *, steps: int = 2000) -> None:
        """A request stores ``keys``' blocks in the primary tier (their bytes: ``content``), and the manager
        cascades them to the store; steps until nothing is pending."""
        self.cascade(*self.stage(keys), steps=steps)

    def stage(self, keys: list[OffloadKey]) -> tuple[ReqContext, Any]:
        """The first half of ``store``: the primary slots are allocated and written (the GPU -> CPU copy)."""
        req = self.open_request()
        out = self.manager.prepare_store(keys, req)
        assert out is not None, "the primary tier refused the store"
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            self.view[slot] = content(key, self.view.shape[1])
        return req, out

    def cascade(self, req: ReqContext, out: Any, *, steps: int = 2000) -> None:
        """The second half: the copy is reported done, the manager cascades the slots to the store."""
        self.manager.complete_store(out.keys_to_store, req)
        self.close_request(req)
        self.settle(steps)

    def settle(self, steps: int = 2000) -> None:
        for _ in range(steps):
            self.step()
            if not self.manager.has_pending_work():
                return
            time.sleep(self.pause_s)
        raise AssertionError(f"jobs still pending after {steps} steps")

    def until_answered(self, keys: list[OffloadKey], req: ReqContext, steps: int = 2000) -> list[LookupResult]:
        """Look ``keys`` up as the connector does each step until none answers RETRY (a hit in the store is
        promoted into the primary tier on the way), then step until no job is pending."""
        for _ in range(steps):
            results = [self.manager.lookup(k, req) for k in keys]
            self.step()
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                self.settle(steps)
                return results
            time.sleep(self.pause_s)
        raise AssertionError(f"lookups still pending after {steps} steps: {results}")

    def load(self, keys: list[OffloadKey]) -> tuple[list[LookupResult], dict[OffloadKey, bytes]]:
        """A request looks ``keys`` up and loads its leading hits out of the primary tier (CPU -> GPU, played by
        reading the slots); the bytes per key."""
        req = self.open_request()
        results = self.until_answered(keys, req)
        hits = 0
        while hits < len(keys) and results[hits] is LookupResult.HIT:
            hits += 1
        got: dict[OffloadKey, bytes] = {}
        if hits:
            spec = self.manager.prepare_load(keys[:hits], req)
            got = {k: self.view[slot].tobytes() for k, slot in zip(keys[:hits], spec.block_ids)}
            self.manager.complete_load(keys[:hits], req)
        self.close_request(req)
        return results, got

    def shutdown(self) -> None:
        self.manager.shutdown()
