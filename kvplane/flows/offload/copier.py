"""Per-layer copies between the device cache and the host pool, on two copy streams.

A save of layer L records an event on the compute stream (``backend.current_stream()``) and makes the save
stream wait for it, so the D2H reads the KV the layer's attention just wrote, without stalling the caller. A
load enqueues each layer's H2D on the load stream and records one event after it; ``wait_for_layer`` waits for
that event only, while later layers keep copying. Plans come from ``block_copy_plan`` over the device regions
of one layer and their host twins: array operations, no Python loop per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend, Event, Stream
from kvplane.kv.regions import Region
from kvplane.plan.local import block_copy_plan

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

    def save(self, layer: str, device_ids: Ids, host_ids: Ids) -> None:
        """Enqueue layer ``layer``'s D2H after the compute enqueued so far."""
        after_compute = self.backend.new_event()
        after_compute.record(self.backend.current_stream())
        if not after_compute.query():  # compute already done (always, on the cpu backend): nothing to order after
            self.save_stream.wait_event(after_compute)
        plan = block_copy_plan(self.device_regions[layer], device_ids, self.host_regions[layer], host_ids)
        self.backend.execute(plan, self.save_stream, direction="d2h")

    def load(self, layer: str, host_ids: Ids, device_ids: Ids) -> Event:
        """Enqueue layer ``layer``'s H2D; the returned event completes with it."""
        plan = block_copy_plan(self.host_regions[layer], host_ids, self.device_regions[layer], device_ids)
        self.backend.execute(plan, self.load_stream, direction="h2d")
        return self.mark(self.load_stream)

    def mark(self, stream: Stream) -> Event:
        """An event after everything enqueued on ``stream`` so far."""
        event = self.backend.new_event()
        event.record(stream)
        return event

    def order_compute_after(self, event: Event) -> None:
        """Make compute wait for ``event``: on a device the compute stream waits, on the cpu backend the caller."""
        self.backend.current_stream().wait_event(event)
