"""Plan-building scenarios (kind ``plan``): ``plan_transfer`` for 10k and 100k tokens of scattered blocks.

The baseline is the bare arithmetic of the same descriptors (one numpy broadcast of ``addr + id * stride``
over all regions, no checks, no coalescing), so the ratio says what the planner's checks and generality cost.
The table shows milliseconds; ``cpu_seconds`` is the calling thread's CPU time (``time.thread_time``).
Manifests carry synthetic addresses: nothing is copied.
"""

from __future__ import annotations

import time

import numpy as np

from kvplane.backend.base import Backend
from kvplane.bench.models import model_spec
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import interleave
from kvplane.blocks.groups import Ids as I64
from kvplane.descriptors import Region, SlotPart
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan.planner import TransferPlan, plan_transfer

BLOCK_TOKENS = 16


def synthetic_manifest(spec: KVSpec, layout: str, num_blocks: int, base: int) -> Manifest:
    """A manifest whose regions sit back to back from ``base`` (split, token-major slots)."""
    regions, addr = [], base
    for layer in spec.layers:
        for slot in layer.slots:
            block = slot.bytes_per_token * BLOCK_TOKENS
            regions.append(
                Region(
                    layer.group_id,
                    layer.index,
                    layer.name,
                    addr,
                    num_blocks,
                    block,
                    block,
                    BLOCK_TOKENS,
                    slot.heads,
                    slot.head_bytes,
                    (SlotPart(slot.name, 0, slot.head_bytes),),
                )
            )
            addr += num_blocks * block
    return Manifest("bench", 0, 1, "cpu", spec, {spec.layers[0].family: layout}, tuple(regions))


def run_plan(backend: Backend, model: str, tokens: int, quick: bool) -> BenchResult:
    spec = model_spec(model, BLOCK_TOKENS)
    layout = "split_kv" if spec.layers[0].family == "gqa" else "mla_split"
    blocks = -(-tokens // BLOCK_TOKENS)
    src = synthetic_manifest(spec, layout, 2 * blocks, 1 << 40)
    dst = synthetic_manifest(spec, layout, 2 * blocks, 1 << 46)
    rng = np.random.default_rng(tokens)
    src_ids = rng.choice(2 * blocks, blocks, replace=False).astype(np.int64)
    dst_ids = rng.choice(2 * blocks, blocks, replace=False).astype(np.int64)
    planned: list[TransferPlan] = []
    raws: list[tuple[I64, I64, I64]] = []

    def ours() -> None:
        planned[:] = [plan_transfer(src, dst, {0: src_ids}, {0: dst_ids}, {0: tokens})]

    s_base = np.array([r.addr for r in src.regions], dtype=np.int64)[:, None]
    d_base = np.array([r.addr for r in dst.regions], dtype=np.int64)[:, None]
    stride = np.array([r.block_stride for r in src.regions], dtype=np.int64)[:, None]

    def raw() -> None:
        s = (s_base + src_ids[None, :] * stride).ravel()
        d = (d_base + dst_ids[None, :] * stride).ravel()
        raws[:] = [(s, d, np.broadcast_to(stride, (len(stride), blocks)).ravel().copy())]

    samples = interleave(ours, raw, 5 if quick else 15, warmup=2, clock=time.thread_time)
    seconds, baseline_seconds = samples.median, samples.baseline_median
    plan = planned[0].plan
    raw_src, raw_dst, raw_len = raws[0]
    order = np.lexsort((raw_dst,))  # verified: the planner's descriptors are exactly the raw ones
    verified = bool(
        plan.total_bytes == int(raw_len.sum()) == tokens * spec.bytes_per_token
        and np.array_equal(np.sort(plan.src), np.sort(raw_src))
        and np.array_equal(plan.dst[np.argsort(plan.dst)], raw_dst[order])
    )
    return make_result(scenario=f"plan-{model}-{tokens // 1000}k", kind="plan", backend=backend.label,
                       transport="none", nbytes=plan.total_bytes, samples=samples,
                       baseline="numpy descriptor arithmetic", verified=verified, descriptors=len(plan),
                       params={
                           "model": model,
                           "tokens": tokens,
                           "descriptors": len(plan),
                           "plan_ms": round(seconds * 1e3, 3),
                           "baseline_ms": round(baseline_seconds * 1e3, 3),
                           "plan_cpu_ms": round(samples.cpu_median * 1e3, 3),
                       })


def scenario(model: str, tokens: int) -> Scenario:
    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_plan(backend, model, tokens, quick)

    return Scenario(f"plan-{model}-{tokens // 1000}k", "plan", run, {"model": model, "tokens": tokens})
