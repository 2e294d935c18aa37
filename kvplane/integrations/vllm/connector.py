"""``KVPlaneConnector``: kvplane behind vLLM's ``KVConnectorBase_V1`` (+ ``SupportsHMA`` for hybrid models).

vLLM builds it twice from the same ``--kv-transfer-config``: once in the scheduler
(``KVConnectorRole.SCHEDULER``: ``SchedulerSide``) and once in every worker (``WORKER``: ``WorkerSide``). This
class only routes each of vLLM's calls to the half that owns it; ``scheduler.py`` and ``worker.py`` say what
happens and in which order vLLM calls them. Load failures are reported block by block through
``get_block_ids_with_load_errors`` when the model has one KV-cache group, and by request otherwise (see
``compat``); vLLM's scheduler applies ``kv_load_failure_policy`` (fail or recompute). With vLLM's KV events on,
the host and store tiers' events go from the workers (``get_kv_connector_kv_cache_events``) to the scheduler half
(``take_events``), which vLLM publishes with its own (``events.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvplane.integrations.vllm.compat import (
    CACHE_HIT_SOURCE,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    transfer_results,
)
from kvplane.integrations.vllm.config import ConnectorConfig, data_parallel_index
from kvplane.integrations.vllm.events import KVPlaneKVEvents, event_hash
from kvplane.integrations.vllm.metadata import KVPlaneMetadata, KVPlaneWorkerMeta
from kvplane.integrations.vllm.scheduler import SchedulerSide
from kvplane.integrations.vllm.stats import KVPlanePromMetrics, KVPlaneStats, WorkerStats
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.logs import configure_logging
from kvplane.startup import log_startup

if TYPE_CHECKING:
    import torch


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError):  # no TP group (a single worker, or a test harness)
        return 0


def _kv_lora_rank(vllm_config: Any) -> int | None:
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_text_config", None) if model_config is not None else None
    rank = getattr(hf, "kv_lora_rank", None)
    return int(rank) if isinstance(rank, int) else None


def _attention_backends(vllm_config: Any, layer_names: list[str]) -> dict[str, Any]:
    """Layer name -> the vLLM attention backend class its layer runs (empty when vLLM has no model loaded)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    except (ImportError, AttributeError, AssertionError, TypeError):
        return {}
    return {name: layer.get_attn_backend() for name, layer in layers.items()}


def _kv_events(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (its scheduler's own test: ``kv_events_config.enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _cache_dtype(vllm_config: Any) -> str:
    return str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto") or "auto")


def _kv_cache_layout() -> str:
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except ImportError:
        return "NHD"


class KVPlaneConnector(KVConnectorBase_V1, SupportsHMA):
    if CACHE_HIT_SOURCE is not None:
        _cache_hit_source = CACHE_HIT_SOURCE.HOST  # vLLM's label where it does not ask per request

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        configure_logging(inside_vllm=True)
        transfer = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        dp_rank = data_parallel_index(parallel)
        self.config = ConnectorConfig.from_extra(
            transfer.kv_connector_extra_config, role=transfer.kv_role, engine_id=str(transfer.engine_id),
            instance_id=str(getattr(vllm_config, "instance_id", "")), tp_size=int(parallel.tensor_parallel_size),
            dp_rank=dp_rank,
        )
        self.load_failure_policy = str(getattr(transfer, "kv_load_failure_policy", "fail"))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._restore: Callable[[], None] | None = None  # the registration to repeat after sleep mode
        self._registered = False
        self._announced = False  # the startup line, once
        self._stats: WorkerStats | None = None
        if role == KVConnectorRole.SCHEDULER:
            sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
            self._scheduler = SchedulerSide(self.config, sizes, int(vllm_config.cache_config.block_size), dp_rank)
            self._scheduler.event_hash = event_hash if _kv_events(vllm_config) else None
        else:
            self._worker = WorkerSide(self.config, kv_cache_config, tp_rank=_tp_rank(), dp_rank=dp_rank,
                                      kv_lora_rank=_kv_lora_rank(vllm_config))
            self._worker.kv_events = _kv_events(vllm_config)
            self._stats = WorkerStats()

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"a scheduler-side method was called on the {self.role.name} connector")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"a worker-side method was called on the {self.role.name} connector")
        return self._worker

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Offload and layer-wise push act in every attention layer, which a full CUDA graph would skip."""
        disagg = extra_config.get("disagg") or {}
        return extra_config.get("offload") is not None or disagg.get("mode") == "layerwise"

    # -- worker side --------------------------------------------------------------------------------------
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """One tensor for all layers (a block of every layer in one range) where vLLM lays it out NHD; with HND
        the layers of a block interleave by head, so per-layer tensors move in fewer descriptors."""
        return self.config.cross_layer_blocks and _kv_cache_layout() == "NHD"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(
            kv_caches, _attention_backends(self._vllm_config, list(kv_caches)), _cache_dtype(self._vllm_config)
        )
        self._restore = lambda: self.register_kv_caches(kv_caches)
        self._registered = True
        self._announce()

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        self.worker.register_cross_layers_kv_cache(kv_cache, attn_backend, _cache_dtype(self._vllm_config))
        self._restore = lambda: self.register_cross_layers_kv_cache(kv_cache, attn_backend)
        self._registered = True
        self._announce()

    def _announce(self) -> None:
        """The startup INFO line (``kvplane.startup.log_startup``, on the ``kvplane`` logger), once the flows are up."""
        w = self.worker
        if not self._announced and w.backend is not None:
            self._announced = True
            log_startup(w.backend, w.layouts, offload=w.offload, prefill=w.prefill, decode=w.decode,
                        engine_id=f"{self.config.engine_id} tp_rank={w.tp_rank} dp_rank={w.dp_rank}",
                        families={layer.family for layer in w.spec.layers} if w.spec is not None else None)

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33's ``gpu_worker.sleep``): the caches are about to be unmapped and vLLM has drained
        the transfers. Every flow closes (they registered the caches with the transfer engines), the host
        tier's contents with them. Idempotent."""
        if self._worker is not None and self._registered:
            self._worker.shutdown()
            self._registered = False

    def restore_kv_caches(self) -> None:
        """After wake-up: the caches are mapped again at the same addresses; the flows reopen on them, through
        whichever registration vLLM made (per-layer tensors or one cross-layer tensor)."""
        if self._worker is not None and not self._registered and self._restore is not None:
            self._restore()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVPlaneMetadata):
            self._worker.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.end_step()

    def finish_forward(self) -> None:
        """vLLM 0.33's model runner: the forward no longer reads this step's KV (nothing kvplane must wait for:
        stores and pushes started during the forward, see ``WorkerSide.save_kv_layer``)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPlaneMetadata):
            raise TypeError(f"expected KVPlaneMetadata from the scheduler, got {type(meta).__name__}")
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Where vLLM asks for it (``compat.REPORTS_FAILED_RECEIVES_BY_REQUEST``): failed receives by request id."""
        sending, recving = self.worker.get_finished()
        return transfer_results(sending, recving, self.worker.take_failed_requests())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVPlaneWorkerMeta | None:
        """Failed receives that ``get_transfer_results`` did not take (a vLLM without it) go to the scheduler
        side this way."""
        failed = self.worker.take_failed_requests() if self._worker is not None else set()
        return KVPlaneWorkerMeta(failed) if failed else None

    def get_kv_connector_stats(self) -> KVPlaneStats | None:
        """This step's counts, transfers and gauges (``stats.WorkerStats``); None when nothing changed."""
        if self._worker is None or self._stats is None:
            return None
        return self._stats.take(self._worker.stats())

    def get_kv_connector_kv_cache_events(self) -> KVPlaneKVEvents | None:
        """The host and store tiers' KV events since the last step (``tier_events``), for the scheduler half."""
        events = self._worker.take_kv_events() if self._worker is not None else []
        return KVPlaneKVEvents(events) if events else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPlaneStats | None:
        return KVPlaneStats.from_data(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPlanePromMetrics:
        """vLLM's Prometheus logger asks for the connector's metrics (``vllm:kvplane_*``) once per frontend."""
        return KVPlanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        """The tiers' events every worker reported (``event_inbox``); vLLM publishes them with its own."""
        return self._scheduler.events.take() if self._scheduler is not None else ()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        if num_external_tokens == 0 or CACHE_HIT_SOURCE is None:
            return {}
        return {CACHE_HIT_SOURCE(self.scheduler.hit_source(request)): num_external_tokens}
