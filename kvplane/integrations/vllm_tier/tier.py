"""``KVPlaneStoreTier``: a vLLM ``SecondaryTierManager`` over kvplane's store tier (``flows/offload/store.py``).

Every method runs in vLLM's scheduler process under its tiering manager's lock, so none of them waits: a store
job is a ``batch_put_from`` of primary slots started on the store tier's put executor, a load job a
``batch_get_into`` into primary slots on its get executor, and ``get_finished_jobs`` reports the calls that have
finished. Existence checks run on vLLM's own ``AsyncLookupManager`` thread (``lookup`` answers RETRY until they
do). A job's primary slots stay vLLM's to pin until the job is reported, and it is reported only once its call
has returned, never at a timeout: a call past its bound turns the store tier off (lookups miss, new jobs fail at
once) while the late call still finishes into slots that are still pinned.

Keys are vLLM's own ``FileMapper`` names under ``namespace`` (the model, dtype, block and cache-group layout
and, unless the layout is parallelism-agnostic, the TP size and rank are in the name), so another model or TP
size never reads these objects. One object is one primary slot (``primary_kv_view.strides[0]`` bytes: a chunk of
``blocks_per_chunk`` blocks on 0.33, one block on 0.27.1). Stored chunks are announced as ``OffloadingEvent``s
with ``medium`` CPU and ``locality`` REMOTE (Mooncake Store is DRAM pooled across the cluster); Mooncake evicts
without telling its clients, so no removal is announced.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering import base as tiering_base
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from kvplane.config import build
from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError
from kvplane.flows.offload.store import StoreTier, StoreWrite

logger = logging.getLogger("kvplane.vllm_tier")
# vLLM 0.33's JobResult names the keys of a partly failed load; 0.27.1's has job_id and success only
_PARTIAL = "successful_keys" in {f.name for f in fields(JobResult)}
# the primary slots of a job: TransferJob.chunk_ids on 0.33, JobMetadata.block_ids on 0.27.1
_CHUNKS = hasattr(tiering_base, "TransferJob")


@dataclass
class _Job:
    """A job whose store call has been started: reported once ``call`` is done."""

    keys: list[OffloadKey]
    sizes: list[int]
    call: StoreWrite
    load: bool  # into the primary tier (a promotion), else out of it
    req_id: str


class _StoreLookups(AsyncLookupManager):
    """vLLM's lookup thread asks the store which keys it holds, one call per step's batch."""

    def __init__(self, tier: KVPlaneStoreTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = self._tier.store.exists(self._tier.names(keys))
        return [False] * len(keys) if found is None else found


class KVPlaneStoreTier(SecondaryTierManager):
    """Mooncake Store as vLLM's secondary tier; ``store`` is kvplane's ``StoreConfig`` as a dict."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        store: dict[str, Any] | None = None,
        enable_kv_events: bool = True,
        locality: str | None = "REMOTE",
        module_path: str | None = None,  # vLLM 0.27.1 passes it on; 0.33 takes it out
        backpressure_detector: Any = None,  # vLLM 0.33 only
    ) -> None:
        kwargs = {} if backpressure_detector is None else {"backpressure_detector": backpressure_detector}
        super().__init__(offloading_spec, primary_kv_view, tier_type, **kwargs)
        if store is None:
            raise OffloadConfigError(
                f"secondary tier {tier_type!r}: 'store' is missing; add \"store\": {{\"master_address\": "
                f"\"host:port\"}} (the address mooncake_master listens on) to its entry in secondary_tiers"
            )
        config = build(StoreConfig, store, what=f"secondary tier {tier_type!r}", error=OffloadConfigError,
                       path="$.store")
        self.locality = None if locality is None else Locality(locality)
        self._mapper = FileMapper.from_offloading_spec(
            config.namespace, offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True)
        assert primary_kv_view.strides is not None
        self._slot_bytes = int(primary_kv_view.strides[0])
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        self.store = StoreTier(config)
        self.store.register(self._base, primary_kv_view.nbytes)  # puts read and gets write it in place
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._jobs: dict[int, _Job] = {}
        self._failed: list[JobResult] = []  # jobs that started no call: reported at the next poll
        self._missing: dict[str, set[OffloadKey]] = {}  # per request, the keys whose load from the store failed
        self._lookups = _StoreLookups(self)

    def names(self, keys: Sequence[OffloadKey]) -> list[str]:
        """The store's name of each key: vLLM's FileMapper path, model and layout included."""
        return [self._mapper.get_file_name(k) for k in keys]

    # -- jobs ---------------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: Any) -> None:
        self._start(job_metadata, load=False)

    def submit_load(self, job_metadata: Any) -> None:
        self._start(job_metadata, load=True)

    def _start(self, job: Any, *, load: bool) -> None:
        slots = np.asarray(job.chunk_ids if _CHUNKS else job.block_ids, dtype=np.int64)
        keys = list(job.keys)
        if len(keys) != slots.size:
            logger.error("job %d has %d keys for %d primary slots; failing it", job.job_id, len(keys), slots.size)
            self._fail(job, keys, load)
            return
        names = self.names(keys)
        addrs = (self._base + slots * self._slot_bytes).tolist()
        sizes = [self._slot_bytes] * len(keys)
        nbytes = self._slot_bytes * len(keys)
        if load:
            future = self.store.start_get(names, addrs, sizes)
        else:  # another instance may have stored the same prefix: move only what the store lacks
            future = self.store.put(names, addrs, sizes, missing_only=True)
        if future is None:  # the store is down: nothing was started, the slots are free at once
            self._fail(job, keys, load)
            return
        deadline = self.store.put_deadline(nbytes, "get" if load else "put")
        call = StoreWrite(future, deadline, 0, slots, nbytes)
        self._jobs[job.job_id] = _Job(keys, sizes, call, load, job.req_context.req_id)

    def _fail(self, job: Any, keys: list[OffloadKey], load: bool) -> None:
        """A job that started no call: reported failed at the next poll; a load's keys miss for its request."""
        if load:
            self._missing.setdefault(job.req_context.req_id, set()).update(keys)
        self._failed.append(JobResult(job_id=job.job_id, success=False))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._failed = self._failed, []
        for job_id, job in list(self._jobs.items()):
            result = self._finish(job_id, job)
            if result is not None:
                del self._jobs[job_id]
                results.append(result)
        return results

    def _finish(self, job_id: int, job: _Job) -> JobResult | None:
        """The job's result once its call has returned, else None (its slots stay pinned)."""
        if job.load:
            ok = self.store.check_get(job.call, job.sizes)
            if ok is None:
                return None
        else:
            if not self.store.check_put(job.call):
                return None
            failed = job.call.future.exception() is not None
            ok = [not failed and rc == 0 for rc in ([] if failed else job.call.future.result())]
        done = [k for k, good in zip(job.keys, ok) if good]
        if job.load and len(done) < len(job.keys):  # the keys that did not load miss for this request from now
            self._missing.setdefault(job.req_id, set()).update(k for k, good in zip(job.keys, ok) if not good)
        elif not job.load and done and self._events is not None:
            self._events.append(OffloadingEvent(keys=done, medium=self.medium, removed=False,
                                                locality=self.locality))
        success = len(done) == len(job.keys)
        if job.load and _PARTIAL and not success:
            return JobResult(job_id=job_id, success=False, successful_keys=done)
        return JobResult(job_id=job_id, success=success)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._failed)

    def drain_jobs(self) -> None:
        """Wait until every started call has returned (vLLM's ``reset_cache``); results stay for the next poll.
        Never abandons a call: a late one would write into slots vLLM had freed."""
        for job in self._jobs.values():
            while not job.call.future.done():
                try:
                    job.call.future.exception(self.store.bound(job.call.nbytes))
                except FutureTimeout:
                    logger.warning("drain_jobs: a store call of %d B is still running", job.call.nbytes)

    # -- lookups and requests -----------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.store.up or key in self._missing.get(req_context.req_id, ()):
            return LookupResult.MISS  # never a hit this request cannot load: it would promote it again and again
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        self._missing.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.store.close()
