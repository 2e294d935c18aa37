"""vLLM's real ``Scheduler`` driving ``KVPlaneConnector``: only the model runner is played here.

``RealEngine`` builds a real ``VllmConfig`` (a tiny Llama config on disk, no weights, no tokenizer, cpu device),
vLLM's ``Scheduler`` (which creates the scheduler-side connector itself, through ``KVConnectorFactory`` and the
module path) and a worker-side connector over paged tensors. ``step`` is one engine step: ``schedule()``, the
worker's connector calls around a fake forward that writes ``MiniEngine.kv_value`` for every scheduled token,
then ``update_from_output``; so async loads (``WAITING_FOR_REMOTE_KVS``), delayed frees, invalid blocks and
``kv_load_failure_policy`` are handled by vLLM's own code.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import torch
from kvref import packed_kv_views
from minivllm import HEAD_DIM, HEADS, MiniEngine
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm_kv_tensors import kv_tensor

init_none_hash(sha256)
# vLLM 0.33's runner starts loads after the forward unless the step has a sync load (0.27.1: always before)
STARTS_LOADS_AFTER_FORWARD = "has_sync_kv_loads" in SchedulerOutput.__dataclass_fields__
BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": HEADS, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "eos_token_id": 2,
    "bos_token_id": 1,
}


def drop_host_tier(worker: Any) -> None:
    """Another request's stores take every host block of ``worker``'s offload: nothing of a prefix is left in the
    host tier (a store-tier test then finds it only in the store)."""
    index = worker.offload.index
    for g in index.pools:
        index.release(g, index.allocate(g, index.pools[g].num_free, worker.offload.store.before_evict))


def tiny_model_dir(root: Path) -> str:
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def reference_digest(tokens: list[int], num_tokens: int, window: int = 0) -> str:
    """``RealEngine.digest`` of a cache that computed ``tokens`` itself."""
    h = hashlib.sha256()
    for li in range(len(LAYERS)):
        for p in range(num_tokens):
            if li and window and p < num_tokens - window:
                continue
            value = MiniEngine.kv_value(tokens[p], p, li)
            h.update(value.numpy().tobytes())
            h.update((-value).numpy().tobytes())
    return h.hexdigest()


class RealEngine:
    def __init__(self, model_dir: str, extra: dict[str, Any], kv_role: str = "kv_both", *,
                 policy: str = "recompute", num_blocks: int = 64, engine_id: str | None = None,
                 max_batched_tokens: int = 512, prefix_caching: bool = False, sliding_window: int = 0,
                 async_scheduling: bool = False, with_worker: bool = True, kv_events: str | None = None) -> None:
        """``sliding_window`` > 0: a hybrid model, layer 0 full attention, layer 1 a sliding window of that many
        tokens, in two KV-cache groups (vLLM's hybrid allocator, ``request_finished_all_groups``).
        ``async_scheduling``: vLLM's ``AsyncScheduler``, stepped as the engine core's batch queue does (step N+1
        is scheduled before step N runs; vLLM's CPU platform turns async scheduling off, so it is forced on).
        ``with_worker=False``: vLLM's scheduler and the scheduler-side connector only (the caller plays the
        worker half's answers). ``kv_events``: vLLM publishes KV events on this endpoint (its ``ZmqEventPublisher``,
        built by its scheduler from ``kv_events_config``)."""
        transfer = KVTransferConfig(
            kv_connector="KVPlaneConnector", kv_connector_module_path="kvplane.integrations.vllm", kv_role=kv_role,
            kv_connector_extra_config=extra, kv_load_failure_policy=policy,
            engine_id=engine_id or f"real-{uuid.uuid4().hex[:8]}",
        )
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                                     max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=1024,
                                             enable_chunked_prefill=True, is_encoder_decoder=False),
            # vLLM's own prefix cache off by default: a repeated prefix must come from kvplane's host tier
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events)
            if kv_events else None,
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        if sliding_window:
            window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32,
                                       sliding_window=sliding_window)
            groups = [KVCacheGroupSpec([LAYERS[0]], spec), KVCacheGroupSpec([LAYERS[1]], window)]
        else:
            groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        self.group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self.window = sliding_window
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        # vLLM's order: workers (and their KV caches) first, then the engine core's scheduler
        self.caches = {name: kv_tensor(FlashAttentionBackend, num_blocks, BLOCK, HEADS, HEAD_DIM,
                                       model_dtype=torch.float32) for name in LAYERS}  # as vLLM's runner builds it
        if with_worker:
            self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
            self.worker.register_kv_caches(self.caches)
        self.config.scheduler_config.async_scheduling = async_scheduling
        self.inflight: deque[Any] | None = deque() if async_scheduling else None
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(vllm_config=self.config, kv_cache_config=kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK)
        self.num_blocks = num_blocks
        # 0.33 can fail one request of a hybrid model (KVConnectorOutput.failed_recving); 0.27.1 cannot
        self.fails_hybrid_requests = STARTS_LOADS_AFTER_FORWARD  # both arrived in 0.33 (KVConnectorOutput.failed_recving)
        self.tables: dict[str, list[list[int]]] = {}  # per request, per KV-cache group
        self.outputs: dict[str, Any] = {}  # request id -> its final EngineCoreOutput
        self.requests: dict[str, Request] = {}
        self.stats: list[Any] = []  # vLLM's SchedulerStats, per step that reported them
        self.timeline: list[tuple[str, str]] = []  # ("step", ""), ("forward", layer), and what tests add
        self.invalid: set[int] = set()
        self.failed: set[str] = set()  # requests reported in failed_recving
        self.digests: dict[str, str] = {}
        self.first_computed: dict[str, int] = {}  # the first token this instance computed, per request
        self.starts: dict[str, list[int]] = {}  # the first token of every forward a request was in

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any] | None = None, max_tokens: int = 1) -> None:
        extra = {"kv_transfer_params": params} if params is not None else None
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                          block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.requests[request_id] = request  # kept: an async step may run after vLLM dropped the request
        self.scheduler.add_request(request)

    def step(self) -> None:
        so = self.scheduler.schedule()
        self._track_blocks(so)
        if self.inflight is not None:  # the batch queue: run the step scheduled before this one
            self.inflight.append(so)
            if len(self.inflight) < 2:
                return
            so = self.inflight.popleft()
        self._execute(so)

    def _track_blocks(self, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(g) for g in new.block_ids]
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = [list(g) for g in blocks] if blocks else []
            elif blocks:
                for table, more in zip(self.tables[rid], blocks):
                    table.extend(more)

    def _execute(self, so: Any) -> None:
        cached = so.scheduled_cached_reqs
        spans = [(new.req_id, new.num_computed_tokens) for new in so.scheduled_new_reqs]
        spans += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)]
        kv_output = self.run_model(so, spans)
        for rid, start in spans:  # the request's KV as it stands after this forward
            self.first_computed.setdefault(rid, start)
            self.starts.setdefault(rid, []).append(start)
            n = start + so.num_scheduled_tokens[rid]
            self.digests[rid] = self.digest(rid, n)
        self.invalid |= kv_output.invalid_block_ids
        self.failed |= getattr(kv_output, "failed_recving", set())
        req_ids = [rid for rid, _ in spans]
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[  # a chunk that leaves part of the prompt for later samples nothing
                [7] if start + so.num_scheduled_tokens[rid] >= self.requests[rid].num_prompt_tokens else []
                for rid, start in spans
            ],
            kv_connector_output=kv_output,
        )
        for engine_outputs in self.scheduler.update_from_output(so, output).values():
            if engine_outputs.scheduler_stats is not None:
                self.stats.append(engine_outputs.scheduler_stats)
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    self.outputs[out.request_id] = out

    def run_model(self, so: Any, spans: list[tuple[str, int]]) -> KVConnectorOutput:
        """The GPU model runner's connector calls, in the installed vLLM's order: ``_get_kv_connector_output`` in
        ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` (0.27.1 lines 78-112: ``start_load_kv`` at line 95,
        before the forward; 0.33.0 lines 67-107: line 83 ``start_after_forward = not has_sync_kv_loads``, so
        ``start_load_kv`` at line 85 before or line 90 after the forward, then ``get_transfer_results``), entered
        by ``gpu_model_runner.py`` (0.27.1 line 4445, 0.33.0 line 4168); a step with no tokens goes through
        ``kv_connector_no_forward`` (0.27.1 line 4234, no ``wait_for_save``; 0.33.0 line 3971). The forward calls
        ``wait_for_layer_load`` / ``save_kv_layer`` in every attention layer."""
        worker = self.worker
        output = KVConnectorOutput()
        self.timeline.append(("step", ""))
        worker.bind_connector_metadata(so.kv_connector_metadata)
        after_forward = STARTS_LOADS_AFTER_FORWARD and not so.has_sync_kv_loads
        if not after_forward:
            worker.start_load_kv(None)
        if so.total_num_scheduled_tokens:
            self.forward(so, spans)
        if after_forward:
            worker.start_load_kv(None)
        if so.total_num_scheduled_tokens or STARTS_LOADS_AFTER_FORWARD:
            worker.wait_for_save()
        if STARTS_LOADS_AFTER_FORWARD:
            results = worker.get_transfer_results(so.finished_req_ids)
            output.finished_sending = results.finished_sending or None
            output.finished_recving = results.finished_recving or None
            output.failed_recving = results.failed_recving
        else:
            output.finished_sending, output.finished_recving = worker.get_finished(so.finished_req_ids)
        output.invalid_block_ids = worker.get_block_ids_with_load_errors()
        output.kv_connector_stats = worker.get_kv_connector_stats()
        output.kv_cache_events = worker.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        return output

    def forward(self, so: Any, spans: list[tuple[str, int]]) -> None:
        """The played model: every attention layer waits for its load, writes ``MiniEngine.kv_value`` for every
        scheduled token into the paged cache, then hands the layer to the connector."""
        for li, name in enumerate(LAYERS):
            self.timeline.append(("forward", name))
            self.worker.wait_for_layer_load(name)
            for rid, start in spans:
                tokens = self.requests[rid].all_token_ids
                for p in range(start, start + so.num_scheduled_tokens[rid]):
                    value = MiniEngine.kv_value(tokens[p], p, li)
                    block = self.tables[rid][self.group_of[name]][p // BLOCK]
                    k, v = packed_kv_views(self.caches[name])
                    k[block, p % BLOCK] = value
                    v[block, p % BLOCK] = -value
            self.worker.save_kv_layer(name, self.caches[name], None)

    def digest(self, rid: str, num_tokens: int) -> str:
        tokens = self.requests[rid].all_token_ids if rid in self.requests else []
        h = hashlib.sha256()
        for name in LAYERS:
            for p in range(min(num_tokens, len(tokens))):
                if self.group_of[name] and p < num_tokens - self.window:
                    continue  # out of the window: vLLM freed that block, nothing reads it
                block = self.tables[rid][self.group_of[name]][p // BLOCK]
                k, v = packed_kv_views(self.caches[name])
                h.update(k[block, p % BLOCK].contiguous().numpy().tobytes())
                h.update(v[block, p % BLOCK].contiguous().numpy().tobytes())
        return h.hexdigest()

    def run_until(self, done: Any, within_s: float = 30.0) -> None:
        end = time.monotonic() + within_s
        while not done():
            if time.monotonic() > end:
                raise AssertionError(f"not done within {within_s} s; waiting: {len(self.scheduler.waiting)}, "
                                     f"running: {len(self.scheduler.running)}")
            self.step()
            time.sleep(0.002)

    def finish(self, request_id: str, within_s: float = 30.0) -> Any:
        self.run_until(lambda: request_id in self.outputs, within_s)
        return self.outputs[request_id]

    def drain(self, within_s: float = 30.0) -> None:
        """Step until the scheduler holds nothing (delayed frees included)."""
        self.run_until(lambda: not self.scheduler.has_requests() and
                       self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == self.num_blocks - 1,
                       within_s)

    def abort(self, request_id: str) -> None:
        """What the engine core does when the client goes away."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def assert_nothing_held(self) -> None:
        """vLLM's own ``assert_scheduler_empty`` checks, then every per-request table of both connector halves."""
        self.step()  # an empty step: vLLM clears the ids it reported finished
        while self.inflight:
            self._execute(self.inflight.popleft())
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0, list(s.requests)
        assert not s.finished_req_ids and not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids, (
            s.finished_req_ids, s.finished_recving_kv_req_ids, s.failed_recving_kv_req_ids)
        for manager in s.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks and not manager.num_cached_block
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        # vLLM's null block stands in for out-of-window blocks of a sliding-window group: its count means nothing
        assert [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null] == []
        assert not s.has_requests()
        held = {**self.scheduler.connector.scheduler.held_request_ids(), **self.worker.worker.held_request_ids()}
        assert not any(held.values()), {k: v for k, v in held.items() if v}

    def freed_by(self, decode: RealEngine, within_s: float = 20.0) -> None:
        """This prefill steps beside ``decode`` until it holds no request any more (a decline or a read from the
        decode freed what it kept), then holds nothing at all."""

        def both_step() -> bool:
            decode.step()
            self.step()
            return False

        self.run_until(lambda: both_step() or not self.scheduler.has_requests(), within_s)
        self.assert_nothing_held()

    def shutdown(self) -> None:
        if hasattr(self, "worker"):
            self.worker.shutdown()
        self.scheduler.shutdown()
