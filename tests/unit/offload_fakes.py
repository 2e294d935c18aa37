"""Stand-ins for the offload tests: a cpu backend whose copies can be held at a gate, an in-memory Mooncake Store
client (same call surface as ``MooncakeDistributedStore``, real memory moves) whose calls can hang, and a small
engine harness that fills device blocks with bytes derived from their prefix hash.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.backend.cpu.streams import WorkerStream
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload import OffloadConfig, OffloadEngine, StoreConfig
from kvplane.flows.offload.store import StoreTier
from kvplane.kv.binding import allocate_cache, slot_tensors
from kvplane.kv.bound import bind
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec

GATE_S = 30.0  # a gate nobody opens gives up after this, so a broken test fails instead of hanging


class GatedCpu(CpuBackend):
    """A cpu backend that counts copies enqueued (each ``execute`` call, and each non-empty part of an
    ``execute_parts`` batch: one layer) and holds copy ``n`` behind ``gates[n]`` on its stream.

    Host memory handed out is summed in ``host_bytes`` (the memory-bound tests read it).
    """

    def __init__(self) -> None:
        super().__init__(copy_threads=1)
        self.calls = 0
        self.gates: dict[int, threading.Event] = {}
        self.host_bytes = 0
        self._part_gates: dict[tuple[int, int], threading.Event] = {}  # (id(plan), begin) -> its gate

    def gate(self, call: int) -> threading.Event:
        event = threading.Event()
        self.gates[call] = event
        return event

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    def _execute(self, plan: CopyPlan, stream: Any, *, direction: Any = None) -> None:
        gate = self.gates.get(self.calls)
        self.calls += 1
        if gate is not None and isinstance(stream, WorkerStream):
            stream.submit(lambda: None if gate.wait(GATE_S) else None)
        super()._execute(plan, stream, direction=direction)

    def execute_parts(self, plan: CopyPlan, bounds: Any, stream: Any, *, direction: Any = None) -> Any:
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                gate = self.gates.get(self.calls)
                self.calls += 1
                if gate is not None:
                    self._part_gates[(id(plan), a)] = gate
        return super().execute_parts(plan, bounds, stream, direction=direction)

    def _copy(self, plan: CopyPlan, begin: int = 0, end: int = -1) -> None:
        gate = self._part_gates.pop((id(plan), begin), None)
        if gate is not None:
            gate.wait(GATE_S)
        super()._copy(plan, begin, end)

    def _alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        self.host_bytes += nbytes
        return super()._alloc_host(nbytes, pinned)


@dataclass
class FakeStoreClient:
    """``MooncakeDistributedStore``'s calls the store tier makes, over a dict; ``hang`` holds every data call."""

    objects: dict[str, bytes] = field(default_factory=dict)
    healthy: bool = True
    health_threads: set[int] = field(default_factory=set)  # the threads health_check was called on
    setup_rc: int = 0
    hang: threading.Event | None = None  # while set to an unset Event, the calls in ``hang_on`` block on it
    hang_on: tuple[str, ...] = ("exist", "put", "get")
    setup_hang: threading.Event | None = None
    calls: list[str] = field(default_factory=list)
    registered: list[tuple[int, int]] = field(default_factory=list)
    closed: bool = False
    fail_with: int | None = None  # every key of every data call returns this code (e.g. -900, a dead master)

    def _maybe_hang(self) -> None:
        if self.hang is not None and self.calls[-1] in self.hang_on:
            self.hang.wait(GATE_S)

    def setup(self, *args: Any) -> int:
        if self.setup_hang is not None:
            self.setup_hang.wait(GATE_S)
        return self.setup_rc

    def health_check(self) -> int:
        self.health_threads.add(threading.get_ident())
        return 0 if self.healthy else 2

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append("exist")
        self._maybe_hang()
        if self.fail_with is not None:
            return [self.fail_with] * len(keys)
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("put")
        self._maybe_hang()
        if self.fail_with is not None:
            return [self.fail_with] * len(keys)
        for k, p, s in zip(keys, ptrs, sizes):
            self.objects[k] = ctypes.string_at(p, s)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("get")
        self._maybe_hang()
        if self.fail_with is not None:
            return [self.fail_with] * len(keys)
        out = []
        for k, p, s in zip(keys, ptrs, sizes):
            data = self.objects.get(k)
            if data is None:
                out.append(-704)
            else:
                ctypes.memmove(p, data, min(s, len(data)))
                out.append(len(data))
        return out

    def close(self) -> int:
        self.closed = True
        return 0


def fake_tier(client: FakeStoreClient, **config: Any) -> StoreTier:
    settings = {"timeout_s": 0.5, "setup_timeout_s": 0.5, "retry_after_s": 3600.0, **config}
    return StoreTier(StoreConfig("127.0.0.1:1", **settings), client=client)


def small_spec(layers: int = 3, tokens_per_block: int = 2) -> KVSpec:
    return KVSpec.gqa(layers, 2, 8, tokens_per_block=tokens_per_block)


def block_bytes_of(seed: int, nbytes: int) -> torch.Tensor:
    """Bytes a block with prefix hash ``seed`` holds: the same on every side, distinct between hashes."""
    rng = np.random.default_rng(seed % (1 << 63))
    return torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))


class Harness:
    """A device cache, an engine on it, and helpers that write and read a block as raw bytes per slot."""

    def __init__(
        self,
        spec: KVSpec,
        host_blocks: int,
        *,
        device_blocks: int = 64,
        layouts: Any = None,
        backend: CpuBackend | None = None,
        store_tier: StoreTier | None = None,
    ) -> None:
        self.backend = backend or CpuBackend(copy_threads=1)
        self.spec = spec
        self.layouts = layouts if layouts is not None else self.backend.layouts
        self.cache: dict[str, LayerValue] = allocate_cache(spec, self.layouts, device_blocks)
        self.slots = slot_tensors(spec, self.cache, self.layouts)
        per_block = sum(st.tensor[0].numel() * st.tensor.element_size() for st in self.slots)
        self.engine = OffloadEngine(bind(self.backend, spec, self.cache, self.layouts),
                                    OffloadConfig(host_bytes=host_blocks * per_block), store_tier=store_tier)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s tensor viewed as ``(blocks, bytes per block)``."""
        t = self.slots[slot].tensor
        return t.view(torch.uint8).reshape(t.shape[0], -1)

    def write(self, block_id: int, block_hash: int) -> None:
        for i in range(len(self.slots)):
            row = self.slot_bytes(i)
            row[block_id] = block_bytes_of(block_hash * 131 + i, row.shape[1])

    def holds(self, block_id: int, block_hash: int) -> bool:
        for i in range(len(self.slots)):
            row = self.slot_bytes(i)
            if not torch.equal(row[block_id], block_bytes_of(block_hash * 131 + i, row.shape[1])):
                return False
        return True

    def zero(self, block_ids: list[int]) -> None:
        for i in range(len(self.slots)):
            self.slot_bytes(i)[block_ids] = 0

    def store(self, request_id: str, hashes: list[int], device_ids: list[int]) -> int:
        for b, h in zip(device_ids, hashes):
            self.write(b, h)
        n = self.engine.start_store(request_id, hashes, device_ids)
        for name in self.spec.layer_names:
            self.engine.save_layer(name)
        self.engine.wait_for_save()
        return n

    def load(self, request_id: str, hashes: list[int], device_ids: list[int]) -> int:
        tokens = self.engine.start_load(request_id, hashes, device_ids)
        for name in self.spec.layer_names:
            self.engine.wait_for_layer(name)
        self.engine.wait_idle()
        return tokens
