"""What the conformance checks share: a small KV spec per layout, caches in device or host memory filled with
random bytes, plans between them, and the byte comparison against torch indexing.

Shapes are real ones made small (bf16, 16-token blocks, GQA 2 heads x 128, DeepSeek MLA 512 + 64, an indexer
of 128): every block is a multiple of 64 bytes, as device DMA engines expect of KV blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend, Direction
from kvplane.descriptors import CopyPlan
from kvplane.kv.binding import allocate_cache, regions_from_tensors, slot_tensors
from kvplane.kv.layouts import LAYOUTS, LayerValue
from kvplane.kv.spec import KVGroup, KVSpec, LayerSpec, SlotSpec
from kvplane.plan.local import block_copy_plan

if TYPE_CHECKING:
    import torch

NUM_LAYERS, TOKENS_PER_BLOCK = 2, 16
SOURCE_BLOCKS, DESTINATION_BLOCKS, MOVED_BLOCKS = 24, 20, 9
Cache = dict[str, LayerValue]


def spec_for(layout: str) -> KVSpec:
    """A two-layer spec of the family ``layout`` stores."""
    family = LAYOUTS[layout].family
    if family == "mla":
        return KVSpec.mla(NUM_LAYERS, tokens_per_block=TOKENS_PER_BLOCK)
    if family == "index":
        slots = (SlotSpec("index", 1, 128),)
        layers = tuple(LayerSpec(f"layers.{i}", i, 0, slots) for i in range(NUM_LAYERS))
        return KVSpec(groups=(KVGroup(0, TOKENS_PER_BLOCK),), layers=layers)
    return KVSpec.gqa(NUM_LAYERS, 2, 128, tokens_per_block=TOKENS_PER_BLOCK)


def memories(direction: Direction) -> tuple[str, str]:
    """(source, destination) memory of a direction: ``"device"`` or ``"host"``."""
    side = {"d": "device", "h": "host"}
    return side[direction[0]], side[direction[2]]


def cache_in(backend: Backend, memory: str, spec: KVSpec, layout: str, num_blocks: int) -> Cache:
    """A zeroed cache carved from one allocation of the backend's device or pinned host memory."""
    alloc = backend.alloc_device if memory == "device" else backend.alloc_host
    cache = allocate_cache(spec, layout, num_blocks, alloc=alloc)
    backend.synchronize()  # zeroing ran on the compute stream; copy streams do not wait for it
    return cache


def fill_random(backend: Backend, spec: KVSpec, cache: Cache, layout: str, seed: int) -> None:
    """Random bytes in every slot, written with torch's own copy (the reference path, not kvplane's)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for st in slot_tensors(spec, cache, layout):
        raw = st.tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    backend.synchronize()


def random_ids(rng: np.random.Generator, num_blocks: int, count: int) -> npt.NDArray[np.int64]:
    return rng.choice(num_blocks, count, replace=False).astype(np.int64)


def plan_between(
    spec: KVSpec, layout: str, src: Cache, src_ids: npt.NDArray[np.int64], dst: Cache,
    dst_ids: npt.NDArray[np.int64],
) -> CopyPlan:
    return block_copy_plan(
        regions_from_tensors(spec, src, layout), src_ids, regions_from_tensors(spec, dst, layout), dst_ids
    )


def mismatches(
    spec: KVSpec, layout: str, src: Cache, src_ids: npt.NDArray[np.int64], dst: Cache,
    dst_ids: npt.NDArray[np.int64],
) -> list[str]:
    """Slots where ``dst[dst_ids] != src[src_ids]`` or a block outside ``dst_ids`` is not zero."""
    import torch

    bad: list[str] = []
    untouched = np.setdiff1d(np.arange(_blocks(spec, dst, layout)), dst_ids)
    for s, d in zip(slot_tensors(spec, src, layout), slot_tensors(spec, dst, layout)):
        want = _host(s.tensor)[torch.from_numpy(src_ids)]
        got = _host(d.tensor)
        if not torch.equal(got[torch.from_numpy(dst_ids)], want):
            bad.append(f"slot {s.slot}: moved blocks differ")
        if got[torch.from_numpy(untouched)].any():
            bad.append(f"slot {s.slot}: blocks outside the plan were written")
    return bad


def _blocks(spec: KVSpec, cache: Cache, layout: str) -> int:
    return int(slot_tensors(spec, cache, layout)[0].tensor.shape[0])


def _host(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.view(torch.uint8).cpu()
