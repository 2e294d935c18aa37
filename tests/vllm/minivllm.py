"""A miniature vLLM around ``KVPlaneConnector``: vLLM's own objects, vLLM's call order, a fake forward.

``MiniEngine`` builds both connectors through ``KVConnectorFactory`` from a ``KVTransferConfig`` naming
``kv_connector_module_path="kvplane.integrations.vllm"``, then plays the scheduler (``Request`` with vLLM's
block hasher, ``KVCacheBlocks``, ``SchedulerOutput``, ``KVConnectorOutput``) and the model runner in the
installed vLLM's order (``step``: ``bind_connector_metadata``, ``start_load_kv`` before the forward, or after it
on 0.33 unless the step loads synchronously, per layer ``wait_for_layer_load`` -> write KV -> ``save_kv_layer``,
``wait_for_save``, ``get_finished`` or 0.33's ``get_transfer_results``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``). The "model" writes
a deterministic function of (token, position, layer) into the paged cache, so any two instances that computed
or received the same tokens hold the same bytes: ``digest`` compares them by token position.

Only what the connector sees is reproduced; vLLM's own prefix cache is off (every request gets fresh blocks).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from kvref import packed_kv_views
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_kv_tensors import cross_layer_tensor, kv_tensor

init_none_hash(sha256)
HEADS, HEAD_DIM = 2, 8
LORA, ROPE = 16, 64  # MLA: vLLM's head_size = kv_lora_rank + rope dim; kvplane reads rope as head_size - 64


@dataclass
class Outcome:
    """What one request did on this instance."""

    request_id: str
    external_tokens: int = 0  # tokens the connector provided (offload hit or remote prefill)
    computed_from: int = 0  # first token this instance computed itself
    kv_transfer_params: dict[str, Any] | None = None
    block_ids: tuple[list[int], ...] = ()
    load_errors: set[int] = field(default_factory=set)
    recomputed: bool = False
    tokens: list[int] = field(default_factory=list)
    digest: str = ""  # of every token's KV at the end, before the blocks were freed (and scrubbed)


def _scheduler_output(new: list[NewRequestData], cached: CachedRequestData, tokens: dict[str, int],
                      sync_load: bool = False) -> SchedulerOutput:
    """``sync_load``: a request of this step loads external tokens synchronously (vLLM 0.33 then starts the loads
    before the forward)."""
    so = SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    if STARTS_LOADS_AFTER_FORWARD:
        so.has_sync_kv_loads = sync_load
    return so


# vLLM 0.33's runner starts loads after the forward unless the step has a sync load (0.27.1: always before)
STARTS_LOADS_AFTER_FORWARD = "has_sync_kv_loads" in SchedulerOutput.__dataclass_fields__
# vLLM 0.27 hands a cross-layer cache to register_cross_layers_kv_cache; 0.33 has no such hook (a layout instead)
CROSS_LAYER_HOOK = hasattr(KVConnectorBase_V1, "register_cross_layers_kv_cache")


def engine_parallel_config(dp_size: int, dp_rank: int, tp_size: int, *, moe: bool) -> ParallelConfig:
    """vLLM's ParallelConfig of DP engine ``dp_rank`` as ``EngineCoreProc.run_engine_core`` (vllm/v1/engine/core.py)
    leaves it: ``data_parallel_index`` the DP rank; for a dense model ``data_parallel_rank`` reset to 0."""
    config = ParallelConfig(tensor_parallel_size=tp_size, data_parallel_size=dp_size)
    config.data_parallel_index = dp_rank
    if moe:
        config.data_parallel_rank = dp_rank
    elif hasattr(config, "reconfigure_for_independent_dp_rank"):  # vLLM 0.33
        config.reconfigure_for_independent_dp_rank()
    else:  # vLLM 0.27.1 does these three assignments inline
        config.data_parallel_size = 1
        config.data_parallel_size_local = 1
        config.data_parallel_rank = 0
    return config


class MiniEngine:
    def __init__(
        self, extra: dict[str, Any], kv_role: str = "kv_both", *, groups: tuple[tuple[int, int], ...] = ((2, 16),),
        num_blocks: int = 48, split_kv: bool = False, policy: str = "recompute", engine_id: str | None = None,
        mla: bool = False, tp_size: int = 1, cross_layer: bool = False, parallel: ParallelConfig | None = None,
    ) -> None:
        """``groups``: (layers, block size) per KV-cache group; ``split_kv``: Ascend-style tuples, (k, v) or for
        ``mla`` (nope, rope); otherwise vLLM CUDA's fused tensors, ``(2, nb, bs, h, d)`` or MLA's ``(nb, bs, 576)``.
        ``tp_size`` > 1: one worker connector per TP rank, each holding ``HEADS / tp_size`` heads (GQA).
        ``cross_layer``: one tensor for all layers, as vLLM allocates it for a connector that prefers cross-layer
        blocks, handed over through ``register_cross_layers_kv_cache`` (one KV-cache group only). ``parallel``: vLLM's
        ``ParallelConfig`` as a DP engine process holds it (its ``tensor_parallel_size`` must be ``tp_size``)."""
        self.mla, self.tp = mla, tp_size
        heads = HEADS // tp_size
        self.transfer_config = KVTransferConfig(
            kv_connector="KVPlaneConnector", kv_connector_module_path="kvplane.integrations.vllm", kv_role=kv_role,
            kv_connector_extra_config=extra, kv_load_failure_policy=policy,
            engine_id=engine_id or f"mini-{uuid.uuid4().hex[:8]}",
        )
        self.block_sizes = [bs for _, bs in groups]
        self.vllm_config = SimpleNamespace(
            kv_transfer_config=self.transfer_config, parallel_config=parallel or ParallelConfig(tensor_parallel_size=tp_size),
            cache_config=CacheConfig(block_size=min(self.block_sizes)),
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False), model_config=None,
            instance_id=uuid.uuid4().hex[:5],
        )
        self.layer_group: dict[str, int] = {}
        group_specs = []
        for g, (layers, bs) in enumerate(groups):
            names = [f"model.layers.{g}.{i}.attn" for i in range(layers)]
            self.layer_group.update(dict.fromkeys(names, g))
            spec = (MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.float32) if mla
                    else FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32))
            group_specs.append(KVCacheGroupSpec(names, spec))
        names = list(self.layer_group)
        tensors = [KVCacheTensor(size=0, shared_by=[name]) for name in names] if cross_layer and CROSS_LAYER_HOOK else []
        self.kv_cache_config = KVCacheConfig(num_blocks, tensors, group_specs)
        self.workers: list[Any] = []
        self.rank_caches: list[dict[str, Any]] = []
        for rank in range(tp_size):  # vLLM's worker processes, each with its TP rank and its share of the heads
            with mock.patch("kvplane.integrations.vllm.connector._tp_rank", return_value=rank):
                worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                             self.kv_cache_config)
            caches: dict[str, Any] = {}
            if cross_layer:  # built as vLLM builds it: 0.27's allocate_uniform_kv_caches, 0.33's block-outermost layout
                backend_cls = TritonMLABackend if mla else FlashAttentionBackend
                with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):  # as in vLLM's worker
                    cross, views = cross_layer_tensor(backend_cls, len(names), num_blocks, self.block_sizes[0],
                                                      1 if mla else heads, LORA + ROPE if mla else HEAD_DIM,
                                                      model_dtype=torch.float32)
                    if CROSS_LAYER_HOOK:
                        assert worker.prefer_cross_layer_blocks  # vLLM asks before it allocates
                        worker.register_cross_layers_kv_cache(cross, backend_cls)
                    else:  # vLLM 0.33: one backing, per-layer views that put a block of every layer in one range
                        worker.register_kv_caches(dict(zip(names, views)))
                caches = dict(zip(names, views))
            for name, g in ({} if cross_layer else self.layer_group).items():
                nb, bs = num_blocks, self.block_sizes[g]
                if split_kv:  # vllm-ascend's tuples: see vllm_ascend_shapes for where these shapes come from
                    caches[name] = ((torch.zeros((nb, bs, 1, LORA)), torch.zeros((nb, bs, 1, ROPE))) if mla
                                    else (torch.zeros((nb, bs, heads, HEAD_DIM)), torch.zeros((nb, bs, heads, HEAD_DIM))))
                else:  # built by vLLM's own shape and stride-order functions, as its GPU model runner does
                    caches[name] = (kv_tensor(TritonMLABackend, nb, bs, 1, LORA + ROPE, model_dtype=torch.float32)
                                    if mla else
                                    kv_tensor(FlashAttentionBackend, nb, bs, heads, HEAD_DIM, model_dtype=torch.float32))
            if not cross_layer:
                worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.rank_caches.append(caches)
        self.worker, self.caches = self.workers[0], self.rank_caches[0]
        self._reports: dict[tuple[str, str], int] = {}  # (sending|recving, request) -> ranks that reported it
        self.scheduler = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                                             self.kv_cache_config)
        self.free = [list(range(num_blocks - 1, 0, -1)) for _ in groups]  # block 0 is vLLM's null block
        self.num_blocks = num_blocks
        self.hasher = get_request_block_hasher(min(self.block_sizes), sha256)
        self.held: dict[str, tuple[list[int], ...]] = {}  # finished, blocks kept for the connector
        self.sent: set[str] = set()

    # -- the "model" ----------------------------------------------------------------------------------
    @staticmethod
    def kv_value(token: int, position: int, layer: int) -> torch.Tensor:
        base = float((token * 31 + position * 7 + layer * 131) % 251)
        return base + torch.arange(HEADS * HEAD_DIM, dtype=torch.float32).reshape(HEADS, HEAD_DIM) / 1000

    def _slots(self, name: str, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Two views whose row ``[block, offset]`` is one token: k and v, or MLA's nope and rope."""
        cache = self.rank_caches[rank][name]
        if self.mla and isinstance(cache, torch.Tensor):
            rows = cache[:, 0] if cache.dim() == 4 else cache  # vLLM 0.33 views MLA as (nb, 1, bs, 576)
            return (rows[..., :LORA], rows[..., LORA:])
        if isinstance(cache, torch.Tensor):
            return packed_kv_views(cache)
        return (cache[0], cache[1])

    def token_rows(self, token: int, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the "model" writes for one token, shaped as ``_slots`` rows."""
        if not self.mla:
            value = self.kv_value(token, position, layer)
            return value, -value
        base = float((token * 31 + position * 7 + layer * 131) % 251)
        row = base + torch.arange(LORA + ROPE, dtype=torch.float32) / 1000
        if isinstance(self.caches[next(iter(self.caches))], tuple):
            return row[:LORA].reshape(1, LORA), row[LORA:].reshape(1, ROPE)
        return row[:LORA], row[LORA:]

    def _write(self, rank: int, name: str, ids: list[int], tokens: list[int], start: int, end: int) -> None:
        g, li = self.layer_group[name], list(self.layer_group).index(name)
        k, v = self._slots(name, rank)
        bs = self.block_sizes[g]
        share = slice(None) if self.mla else slice(rank * HEADS // self.tp, (rank + 1) * HEADS // self.tp)
        for p in range(start, end):
            a, b = self.token_rows(tokens[p], p, li)
            k[ids[p // bs], p % bs] = a[share]
            v[ids[p // bs], p % bs] = b[share]

    def _row(self, name: str, slot: int, block: int, offset: int) -> torch.Tensor:
        """One token's row of one slot, its heads gathered over the TP ranks (MLA: replicated, rank 0)."""
        ranks = range(1 if self.mla else self.tp)
        return torch.cat([self._slots(name, r)[slot][block, offset] for r in ranks])

    def digest(self, block_ids: tuple[list[int], ...], num_tokens: int) -> str:
        """A hash of the KV of tokens ``[0, num_tokens)`` in every layer, read through the block tables."""
        h = hashlib.sha256()
        for name, g in self.layer_group.items():
            bs = self.block_sizes[g]
            for p in range(num_tokens):
                b = block_ids[g][p // bs]
                h.update(self._row(name, 0, b, p % bs).numpy().tobytes())
                h.update(self._row(name, 1, b, p % bs).numpy().tobytes())
        return h.hexdigest()

    def reference_digest(self, tokens: list[int], num_tokens: int) -> str:
        """``digest`` of a cache that computed ``tokens`` itself."""
        h = hashlib.sha256()
        for li in range(len(self.layer_group)):
            for p in range(num_tokens):
                a, b = self.token_rows(tokens[p], p, li)
                h.update(a.numpy().tobytes())
                h.update(b.numpy().tobytes())
        return h.hexdigest()

    # -- one step of the model runner -----------------------------------------------------------------
    def step(self, so: SchedulerOutput, writes: list[tuple[tuple[list[int], ...], list[int], int, int]]) -> set[int]:
        """One step of every rank's model runner, its connector calls in the installed vLLM's order (see
        ``realsched.RealEngine.run_model``: 0.33 starts loads after the forward unless the step loads
        synchronously, waits for saves in every step and takes results through ``get_transfer_results``)."""
        meta = self.scheduler.build_connector_meta(so)
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        errors: set[int] = set()
        worker_meta: Any = None
        after_forward = STARTS_LOADS_AFTER_FORWARD and not so.has_sync_kv_loads
        for rank, worker in enumerate(self.workers):  # vLLM runs the ranks in parallel; in turn is enough here
            worker.bind_connector_metadata(meta)
            if not after_forward:
                worker.start_load_kv(None)
            for name, g in (self.layer_group if writes else {}).items():
                worker.wait_for_layer_load(name)
                for ids, tokens, start, end in writes:
                    self._write(rank, name, ids[g], tokens, start, end)
                worker.save_kv_layer(name, self.rank_caches[rank][name], None)
            if after_forward:
                worker.start_load_kv(None)
            if writes or STARTS_LOADS_AFTER_FORWARD:  # 0.27.1's no-forward step does not wait for saves
                worker.wait_for_save()
            if STARTS_LOADS_AFTER_FORWARD:
                results = worker.get_transfer_results(so.finished_req_ids)
                rank_sending, rank_recving = results.finished_sending, results.finished_recving
                failed |= results.failed_recving
            else:
                rank_sending, rank_recving = worker.get_finished(so.finished_req_ids)
            errors |= worker.get_block_ids_with_load_errors()
            rank_meta = worker.build_connector_worker_meta()
            if rank_meta is not None:  # vLLM's KVOutputAggregator aggregates the ranks' metadata
                worker_meta = rank_meta if worker_meta is None else worker_meta.aggregate(rank_meta)
            worker.clear_connector_metadata()
            # vLLM's KVOutputAggregator: a request is finished once every rank reported it
            for kind, ids, out in (("s", rank_sending, sending), ("r", rank_recving, recving)):
                for rid in ids or ():
                    n = self._reports[(kind, rid)] = self._reports.get((kind, rid), 0) + 1
                    if n == self.tp:
                        del self._reports[(kind, rid)]
                        out.add(rid)
        output = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                   invalid_block_ids=errors, kv_connector_worker_meta=worker_meta)
        if STARTS_LOADS_AFTER_FORWARD:
            output.failed_recving = failed
        self.scheduler.update_connector_output(output)
        for rid in sending or ():
            self.sent.add(rid)
            self._release(self.held.pop(rid, ()))
        self._recving = getattr(self, "_recving", set()) | (recving or set())
        return errors

    def idle_step(self) -> set[int]:
        return self.step(_scheduler_output([], CachedRequestData.make_empty(), {}), [])

    def pump(self, request_id: str, within_s: float = 30.0) -> None:
        """Step without work until the connector gives back ``request_id``'s held blocks."""
        end = time.monotonic() + within_s
        while request_id in self.held:
            if time.monotonic() > end:
                raise AssertionError(f"{request_id} still held after {within_s} s")
            self.idle_step()
            time.sleep(0.005)

    # -- a request from arrival to finish -------------------------------------------------------------
    def _allocate(self, tokens: int) -> tuple[list[int], ...]:
        return tuple([free.pop() for _ in range(-(-tokens // bs))] for free, bs in zip(self.free, self.block_sizes))

    def _release(self, ids: tuple[list[int], ...]) -> None:
        """Free the blocks, scrubbed, so bytes found there later must have been loaded or received."""
        for g, (free, group) in enumerate(zip(self.free, ids)):
            free.extend(group)
            for name, layer_group in self.layer_group.items():
                for rank in range(self.tp):
                    if layer_group == g:
                        for slot in self._slots(name, rank):
                            slot[group] = 0

    @property
    def whole(self) -> bool:
        return all(len(free) == self.num_blocks - 1 for free in self.free)

    def run(self, request_id: str, prompt: list[int], params: dict[str, Any] | None = None, max_tokens: int = 1,
            within_s: float = 30.0, after_alloc: Callable[[], None] | None = None) -> Outcome:
        """Schedule, run and finish one request; ``after_alloc`` runs between the scheduler's decision and the
        worker's step (where an eviction or a dying peer would strike)."""
        extra = {"kv_transfer_params": params} if params is not None else None
        req = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                      block_hasher=self.hasher)
        self.scheduler.on_new_request(req)
        out = Outcome(request_id)
        ext, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        end = time.monotonic() + within_s
        while ext is None:  # vLLM skips the request this step and asks again in the next one
            if time.monotonic() > end:
                raise AssertionError(f"{request_id}: get_num_new_matched_tokens said 'not yet' for {within_s} s")
            time.sleep(0.001)
            ext, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        ids = self._allocate(len(prompt) + max_tokens)
        out.block_ids = ids
        self.scheduler.update_state_after_alloc(req, KVCacheBlocks(tuple([KVCacheBlock(i) for i in g] for g in ids)),
                                                ext)
        out.external_tokens = ext
        computed = ext
        if after_alloc is not None:
            after_alloc()
        if is_async:  # WAITING_FOR_REMOTE_KVS: vLLM keeps stepping until the worker reports the request
            end = time.monotonic() + within_s
            self._recving = set()
            while request_id not in self._recving:
                if time.monotonic() > end:
                    raise AssertionError(f"{request_id} not received within {within_s} s")
                out.load_errors |= self.idle_step()
                time.sleep(0.005)
            if out.load_errors:
                computed, out.recomputed = 0, True  # the "recompute" policy: vLLM drops the invalid blocks
            computed = min(computed, len(prompt) - 1)  # vLLM computes the last prompt token itself
            self.scheduler.update_state_after_alloc(req, KVCacheBlocks(tuple([] for _ in ids)), 0)
        req.num_computed_tokens = computed
        new = NewRequestData.from_request(req, ids)
        so = _scheduler_output([new], CachedRequestData.make_empty(), {request_id: len(prompt) - computed},
                               sync_load=computed > 0 and not is_async)
        errors = self.step(so, [(ids, list(prompt), computed, len(prompt))])
        if errors:  # a synchronous load that came up short: recompute the whole prompt, as vLLM would
            out.load_errors |= errors
            out.recomputed = True
            computed = 0
            self.step(_scheduler_output([], CachedRequestData.make_empty(), {}), [(ids, list(prompt), 0, len(prompt))])
        out.computed_from = computed
        req.num_computed_tokens = len(prompt)
        tokens = list(prompt)
        for i in range(max_tokens - 1):  # decode steps: one token each, as a cached request
            token = (sum(tokens) + i) % 1000
            req.append_output_token_ids(token)
            tokens.append(token)
            cached = CachedRequestData(
                req_ids=[request_id], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                new_block_ids=[None], num_computed_tokens=[req.num_computed_tokens], num_output_tokens=[i + 1],
            )
            self.step(_scheduler_output([], cached, {request_id: 1}), [(ids, tokens, len(tokens) - 1, len(tokens))])
            req.num_computed_tokens += 1
        out.tokens, out.digest = tokens, self.digest(ids, len(tokens))
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if len(ids) > 1:
            delay, out.kv_transfer_params = self.scheduler.request_finished_all_groups(req, ids)
        else:
            delay, out.kv_transfer_params = self.scheduler.request_finished(req, ids[0])
        if delay:
            self.held[request_id] = ids
        else:
            self._release(ids)
        return out

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()
