"""A store hands the save stream a few batches of layers, not one task per layer (issue 14, item 2).

The backend here finishes every copy before ``execute_parts`` returns, so the save stream is idle whenever
``save_layer`` looks at it: the worst case for hand-offs (a fast copy, or the bench's stubbed one).
"""

from __future__ import annotations

from typing import Any

from offload_fakes import Harness

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.blocks import block_hashes
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.engine import SAVE_TASKS
from kvplane.kv.spec import KVSpec


class CountingCpu(CpuBackend):
    """Counts the tasks handed to streams; each finishes before the call returns (the stream is then idle)."""

    def __init__(self) -> None:
        super().__init__(copy_threads=1)
        self.tasks = 0

    def execute_parts(self, plan: CopyPlan, bounds: Any, stream: Any, *, direction: Any = None) -> Any:
        self.tasks += 1
        events = super().execute_parts(plan, bounds, stream, direction=direction)
        stream.synchronize()
        return events


def test_a_61_layer_store_goes_to_an_idle_save_stream_in_at_most_save_tasks_batches_and_lands_byte_exactly() -> None:
    backend = CountingCpu()
    spec = KVSpec.mla(61, kv_lora_rank=16, rope_dim=8, tokens_per_block=2)
    h = Harness(spec, host_blocks=8, backend=backend)
    hashes = block_hashes(list(range(6)), 2)
    for b, x in zip([5, 9, 2], hashes):
        h.write(b, x)
    assert h.engine.start_store("r", hashes, [5, 9, 2]) == 3
    for name in spec.layer_names:
        h.engine.save_layer(name)
    assert 1 < backend.tasks <= SAVE_TASKS + 1  # batches of layers, not 61 tasks
    h.engine.wait_for_save()
    assert h.engine.get_finished() == ({"r"}, set())
    h.zero([5, 9, 2])
    assert h.load("l", hashes, [20, 21, 22]) == 6
    assert all(h.holds(b, x) for b, x in zip([20, 21, 22], hashes))
