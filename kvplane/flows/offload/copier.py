"""Per-layer copies between the device cache and the host pool, on two copy streams.

A save of layers records an event on the compute stream (``backend.current_stream()``) and makes the save
stream wait for it, so the D2H reads the KV the layers' attention just wrote, without stalling the caller
(the engine may hand several layers over at once, after the latest layer's compute). A load enqueues every
layer's H2D on the load stream as one batch (``Backend.execute_parts``) with an event after each layer;
``wait_for_layer`` waits for that event only, while later layers keep copying. Plans for every layer of a
request come from one ``LayerPlanner`` call over the device regions and their host twins: one plan with each
layer's bounds in it, from array operations, with no Python loop per block or per layer. The planners write
plans into one shared ``PlanBuffers``; the engine gives a plan back (``recycle``) once its copies completed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvplane.backend.base import Backend, Event, Stream
from kvplane.blocks.groups import Ids
from kvplane.descriptors import CopyPlan, Region
from kvplane.flows.offload.layer_plans import LayerPlanner, PlanBuffers


class LayerCopier:
    def __init__(
        self,
        backend: Backend,
        device_regions: Mapping[str, Sequence[Region]],
        host_regions: Mapping[str, Sequence[Region]],
    ) -> None:
        self.backend = backend
        self.device_regions = device_regions
        self.host_regions = host_regions
        self.save_stream: Stream = backend.new_stream()
        self.load_stream: Stream = backend.new_stream()
        self._save_planners: dict[tuple[str, ...], LayerPlanner] = {}
        self._load_planners: dict[tuple[str, ...], LayerPlanner] = {}
        self._buffers = PlanBuffers()

    def save_planner(self, layers: Sequence[str]) -> LayerPlanner:
        """The planner of ``save_parts`` for ``layers``, for a caller that keeps it (no lookup per request)."""
        return self._planner(self._save_planners, layers, self.device_regions, self.host_regions)

    def load_planner(self, layers: Sequence[str]) -> LayerPlanner:
        """The planner of ``load_parts`` for ``layers`` (call its ``sliced_parts(host_ids, device_ids)``)."""
        return self._planner(self._load_planners, layers, self.host_regions, self.device_regions)

    def save_parts(self, layers: Sequence[str], device_ids: Ids, host_ids: Ids) -> tuple[CopyPlan, list[int]]:
        """D2H of ``layers`` (one KV-cache group) as one plan and each layer's bounds in it."""
        return self._planner(self._save_planners, layers, self.device_regions, self.host_regions).parts(
            device_ids, host_ids
        )

    def load_parts(self, layers: Sequence[str], host_ids: Ids, device_ids: Ids) -> tuple[CopyPlan, list[int]]:
        """H2D of ``layers`` (one KV-cache group) as one plan and each layer's bounds in it; over cross-layer
        caches the plan comes in runs of layers, so layer-wise waits keep their overlap (``sliced_parts``)."""
        return self._planner(self._load_planners, layers, self.host_regions, self.device_regions).sliced_parts(
            host_ids, device_ids
        )

    def after_compute(self) -> Event | None:
        """An event after the compute enqueued so far (a layer's KV is written once it completes), or None when
        the compute stream has nothing left to run (the cpu backend's, always): no event to make or wait for."""
        stream = self.backend.current_stream()
        return None if stream.query() else self.mark(stream)

    def save(self, plan: CopyPlan, after: Event | None) -> None:
        """Enqueue a D2H plan once ``after`` (from ``after_compute``) has completed."""
        if after is not None and not after.query():  # compute already done (always, on the cpu backend)
            self.save_stream.wait_event(after)
        self.backend.execute(plan, self.save_stream, direction="d2h")

    def save_range(self, plan: CopyPlan, begin: int, end: int, after: Event | None) -> None:
        """Enqueue descriptors ``[begin, end)`` of a D2H plan (consecutive layers) once ``after`` completed."""
        if after is not None and not after.query():
            self.save_stream.wait_event(after)
        self.backend.execute_parts(plan, [begin, end], self.save_stream, direction="d2h")

    def load(self, plan: CopyPlan) -> Event:
        """Enqueue one layer's H2D plan; the returned event completes with it."""
        self.backend.execute(plan, self.load_stream, direction="h2d")
        return self.mark(self.load_stream)

    def load_all(self, plan: CopyPlan, bounds: Sequence[int]) -> list[Event]:
        """Enqueue the H2D of every layer as one batch; event ``i`` completes with layer ``i``'s part."""
        return self.backend.execute_parts(plan, bounds, self.load_stream, direction="h2d")

    def recycle(self, plan: CopyPlan) -> None:
        """A plan from ``save_parts``/``load_parts`` whose copies completed: its memory may hold a later plan.
        Only once nothing reads it any more (the event after its last copy completed)."""
        self._buffers.give_back(plan)

    def _planner(
        self,
        cache: dict[tuple[str, ...], LayerPlanner],
        layers: Sequence[str],
        src: Mapping[str, Sequence[Region]],
        dst: Mapping[str, Sequence[Region]],
    ) -> LayerPlanner:
        key = tuple(layers)
        planner = cache.get(key)
        if planner is None:
            planner = cache[key] = LayerPlanner(key, src, dst, self._buffers)
        return planner

    def mark(self, stream: Stream) -> Event:
        """An event after everything enqueued on ``stream`` so far."""
        event = self.backend.new_event()
        event.record(stream)
        return event

    def order_compute_after(self, event: Event) -> None:
        """Make compute wait for ``event``: on a device the compute stream waits, on the cpu backend the caller."""
        self.backend.current_stream().wait_event(event)
