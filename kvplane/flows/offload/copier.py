"""Per-layer copies between the device cache and the host pool, on two copy streams.

A save of layer L records an event on the compute stream (``backend.current_stream()``) and makes the save
stream wait for it, so the D2H reads the KV the layer's attention just wrote, without stalling the caller
(the engine may hand several layers' plans over at once, after the latest layer's event). A
load enqueues each layer's H2D on the load stream and records one event after it; ``wait_for_layer`` waits for
that event only, while later layers keep copying. Plans for every layer of a request come from one
``LayerPlanner`` call over the device regions and their host twins: array operations, no Python loop per block
(nor per layer, until each layer's plan is enqueued).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend, Event, Stream
from kvplane.descriptors import CopyPlan, Region
from kvplane.flows.offload.layer_plans import LayerPlanner

Ids = npt.NDArray[np.int64]


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

    def save_plans(self, layers: Sequence[str], device_ids: Ids, host_ids: Ids) -> dict[str, CopyPlan]:
        """D2H plans of ``layers`` (one KV-cache group) for these blocks, built all at once."""
        return self._planner(self._save_planners, layers, self.device_regions, self.host_regions).plans(
            device_ids, host_ids
        )

    def load_plans(self, layers: Sequence[str], host_ids: Ids, device_ids: Ids) -> dict[str, CopyPlan]:
        """H2D plans of ``layers`` (one KV-cache group) for these blocks, built all at once."""
        return self._planner(self._load_planners, layers, self.host_regions, self.device_regions).plans(
            host_ids, device_ids
        )

    def after_compute(self) -> Event:
        """An event after the compute enqueued so far (a layer's KV is written once it completes)."""
        return self.mark(self.backend.current_stream())

    def save(self, plan: CopyPlan, after: Event | None) -> None:
        """Enqueue a D2H plan once ``after`` (from ``after_compute``) has completed."""
        if after is not None and not after.query():  # compute already done (always, on the cpu backend)
            self.save_stream.wait_event(after)
        self.backend.execute(plan, self.save_stream, direction="d2h")

    def load(self, plan: CopyPlan) -> Event:
        """Enqueue one layer's H2D plan; the returned event completes with it."""
        self.backend.execute(plan, self.load_stream, direction="h2d")
        return self.mark(self.load_stream)

    @staticmethod
    def _planner(
        cache: dict[tuple[str, ...], LayerPlanner],
        layers: Sequence[str],
        src: Mapping[str, Sequence[Region]],
        dst: Mapping[str, Sequence[Region]],
    ) -> LayerPlanner:
        key = tuple(layers)
        planner = cache.get(key)
        if planner is None:
            planner = cache[key] = LayerPlanner(key, src, dst)
        return planner

    def mark(self, stream: Stream) -> Event:
        """An event after everything enqueued on ``stream`` so far."""
        event = self.backend.new_event()
        event.record(stream)
        return event

    def order_compute_after(self, event: Event) -> None:
        """Make compute wait for ``event``: on a device the compute stream waits, on the cpu backend the caller."""
        self.backend.current_stream().wait_event(event)
