"""P/D through the disaggregation flow (kind ``pd``): a ``PrefillSide`` and a ``DecodeSide`` in this process,
each with its own transport engine on 127.0.0.1 and its own ZMQ socket, move 10k tokens of scattered blocks
the way an engine pair would: pull, push, and layer-wise push behind a simulated prefill.

The figure is the time from *prefill done* (``request_finished``, or the last ``save_layer``) to *KV ready at
decode* (``get_finished`` reports the request done): side channel, planning, transfer and completion messages
included. The baseline is the raw engine moving the same blocks (the plan's descriptors through its own batch
calls) in the same run, so ``ratio`` is what the flow costs over bare bytes on the wire.

Block ids are ``scatter`` (random) or ``runs`` (mostly consecutive, as a fresh request's are); the baseline
moves one descriptor per block and layer slot either way, as a raw engine does with vLLM's per-layer blocks.

Caches are per-layer tensors, or (``cross_layer``, the ``-xl`` rows) vLLM's one tensor for all layers on both
sides, where a block of every layer is one descriptor; the baseline still moves one per block and layer.

``descriptors`` is what the flow handed its engine per request (median over the reps, counted by the moving
side's transport): the plan's own count for pull and push, more for layer-wise push, whose writes carry one
layer or a few (``plan_descriptors`` is the whole-request plan's).

NIXL rows report ``prep_paths``: how many of the moving side's plans went through its prepared descriptor lists.

Layer-wise push runs the prefill as ``PREFILL_COMPUTE_S`` of simulated compute split evenly over the layers
(seed 001's local prefill of 10k tokens took 470 ms), saving each layer as it ends. In the same run a whole-request
push of the same blocks is timed; ``hidden`` is the share of that push's time that no longer shows after prefill
done, ``1 - exposed / push``. It can exceed ``compute / push``: per-layer writes are smaller transfers, two in
flight at once (layers saved meanwhile leave together), which on loopback can finish sooner than one
whole-request transfer.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvplane.backend.base import Backend
from kvplane.bench.block_ids import Pattern, per_block_plan, request_ids
from kvplane.bench.held import Held
from kvplane.bench.models import model_spec
from kvplane.bench.peer import KVBuffer
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples, timed_cpu
from kvplane.errors import KvplaneError
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide, TransferParams
from kvplane.kv.binding import LayoutChoice
from kvplane.kv.bound import bind
from kvplane.plan.planner import plan_transfer
from kvplane.transports.base import Op, Transport
from kvplane.transports.nixl import NixlTransport

Mode = Literal["pull", "push", "layerwise"]
BLOCK_TOKENS = 16
TOKENS, QUICK_TOKENS = 10_000, 2_000
PREFILL_COMPUTE_S = 0.470  # per 10k tokens, scaled with the request
ENGINES = ("mooncake", "nixl")
MODELS = ("qwen3-0.6b", "deepseek-v3")
MODES: tuple[Mode, ...] = ("pull", "push", "layerwise")
WAIT_S = 120.0
REGISTER_S = 0.05
POLL_S = 0.001


@dataclass
class Sides:
    prefill: PrefillSide
    decode: DecodeSide
    p_kv: KVBuffer
    d_kv: KVBuffer

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


_held: Held[Sides] = Held(Sides.close)  # one pair at a time, shared by the three modes of an engine and model


def _sides(
    backend: Backend, engine: str, model: str, tokens: int, layouts: LayoutChoice | None, cross_layer: bool
) -> Sides:
    def build() -> Sides:
        spec = model_spec(model, BLOCK_TOKENS)
        layout = backend.layouts[spec.layers[0].family] if layouts is None else layouts
        num_blocks = 2 * -(-tokens // BLOCK_TOKENS)
        p_kv = KVBuffer(spec, layout, num_blocks, backend.alloc_device, cross_layer=cross_layer)
        d_kv = KVBuffer(spec, layout, num_blocks, backend.alloc_device, cross_layer=cross_layer)
        p_kv.fill(1)
        tag = uuid.uuid4().hex[:6]
        common: dict[str, Any] = {"transport": engine, "transfer_timeout_s": WAIT_S, "push_timeout_s": WAIT_S,
                                  "lease_s": WAIT_S, "port": 0}
        prefill = PrefillSide(bind(backend, spec, p_kv.cache, layout),
                              DisaggConfig(engine_id=f"bench-p-{tag}", **common))
        decode = DecodeSide(bind(backend, spec, d_kv.cache, layout),
                            DisaggConfig(engine_id=f"bench-d-{tag}", **common))
        return Sides(prefill, decode, p_kv, d_kv)

    return _held.get((backend.label, engine, model, tokens, repr(layouts), cross_layer), build)


def close_all() -> None:
    _held.release()


def _wait_done(side: PrefillSide | DecodeSide, request_id: str) -> float:
    """Poll ``get_finished`` until ``request_id`` is reported; the monotonic time it was seen done."""
    end = time.monotonic() + WAIT_S
    while True:
        for c in side.get_finished():
            if c.request_id == request_id:
                if c.state != "done":
                    raise KvplaneError(f"bench request {request_id} ended {c.state}: {c.reason}")
                return time.monotonic()
        if time.monotonic() > end:
            raise KvplaneError(f"bench request {request_id} not done within {WAIT_S} s")
        time.sleep(POLL_S)  # gentle: a tight poll takes CPU from the engines on a small machine


def _push_params(sides: Sides, request_id: str) -> TransferParams:
    """What a proxy hands decode before the prefill runs (push modes)."""
    return TransferParams.for_push(sides.prefill.config.engine_id, request_id, "127.0.0.1", sides.prefill.base_port)


def one_request(sides: Sides, mode: Mode, p_ids: np.ndarray, d_ids: np.ndarray, tokens: int, compute_s: float) -> float:
    """One request through the flow: seconds from prefill done to KV ready at decode."""
    rid = f"bench-{uuid.uuid4().hex[:10]}"
    prefill, decode = sides.prefill, sides.decode
    if mode == "pull":
        done = time.monotonic()
        params = prefill.request_finished(rid, {0: p_ids}, tokens)
        decode.start_pull(rid, params, {0: d_ids}, tokens)
    else:
        params = _push_params(sides, rid)
        decode.register_push(rid, params, {0: d_ids}, tokens)
        time.sleep(REGISTER_S)  # decode registers while the prefill computes: let the registration land first
        if mode == "layerwise":
            prefill.start_request(rid, {0: p_ids}, tokens, token=params.kvplane_token)
            per_layer = compute_s / len(sides.p_kv.spec.layers)
            for layer in sides.p_kv.spec.layer_names:
                time.sleep(per_layer)  # the layer's compute; the I/O loop writes earlier layers meanwhile
                prefill.save_layer(layer)
        done = time.monotonic()
        prefill.request_finished(rid, {0: p_ids}, tokens, token=params.kvplane_token)
    ready = _wait_done(decode, rid)
    _wait_done(prefill, rid)  # the prefill side released the blocks: the next request starts clean
    return ready - done


def run_flow(
    backend: Backend, engine: str, model: str, mode: Mode, quick: bool, pattern: Pattern = "scatter",
    layouts: LayoutChoice | None = None, name: str | None = None, tokens: int | None = None,
    cross_layer: bool = False,
) -> BenchResult:
    tokens = tokens if tokens is not None else QUICK_TOKENS if quick else TOKENS
    sides = _sides(backend, engine, model, tokens, layouts, cross_layer)
    blocks = -(-tokens // BLOCK_TOKENS)
    rng = np.random.default_rng({"pull": 11, "push": 12, "layerwise": 13}[mode])
    p_ids = request_ids(pattern, 2 * blocks, blocks, rng)
    d_ids = request_ids(pattern, 2 * blocks, blocks, rng)
    compute_s = PREFILL_COMPUTE_S * tokens / TOKENS

    sides.d_kv.buffer.zero_()
    first = one_request(sides, mode, p_ids, d_ids, tokens, compute_s)  # also the handshake, which is not timed again
    verified = sides.d_kv.digest(d_ids) == sides.p_kv.digest(p_ids)

    op: Op = "READ" if mode == "pull" else "WRITE"
    mover: Transport = sides.decode.local.transport if op == "READ" else sides.prefill.local.transport
    other = sides.prefill.local if op == "READ" else sides.decode.local
    handle = mover.connect(other.transport.peer_info())
    p_man, d_man = sides.prefill.local.manifest, sides.decode.local.manifest
    plan = plan_transfer(p_man, d_man, {0: p_ids}, {0: d_ids}, {0: tokens}).plan
    raw_plan = per_block_plan(p_man.regions, p_ids, d_man.regions, d_ids)

    samples, pushes, moved = Samples(), [], []
    for _ in range(MIN_REPS):
        # wall: prefill done -> KV ready; CPU: the whole request in this process (both sides' threads)
        ready: list[float] = []
        before = mover.submitted.descriptors
        _, cpu = timed_cpu(lambda: ready.append(one_request(sides, mode, p_ids, d_ids, tokens, compute_s)))  # noqa: B023
        moved.append(mover.submitted.descriptors - before)
        samples.ours.append(ready[0])
        samples.cpu.append(cpu)
        start = time.perf_counter()
        mover.raw_move(handle, op, raw_plan)
        samples.baseline.append(time.perf_counter() - start)
        if mode == "layerwise":
            pushes.append(one_request(sides, "push", p_ids, d_ids, tokens, compute_s))
    seconds, baseline_seconds = samples.median, samples.baseline_median
    params: dict[str, Any] = {
        "model": model, "mode": mode, "blocks_pattern": pattern, "tokens": tokens, "block_tokens": BLOCK_TOKENS,
        "baseline_descriptors": len(raw_plan), "plan_descriptors": len(plan),
        "first_request_ms": round(first * 1e3, 1),
        "prefill_done_to_kv_ready_ms": round(seconds * 1e3, 1), "raw_ms": round(baseline_seconds * 1e3, 1),
        "sides": "one process, two transport engines on 127.0.0.1",
        "cache": "cross-layer" if cross_layer else "per-layer",
    }
    if isinstance(mover, NixlTransport):  # which path the flow's plans took (prepared lists or not), and why
        params["prep_paths"] = mover.prep_stats.as_dict()
    if mode == "layerwise":
        params.update(_hidden(compute_s, seconds, statistics.median(pushes)))
    return make_result(scenario=name or _name(engine, model, mode, pattern), kind="pd", backend=backend.label,
                       transport=engine, nbytes=plan.total_bytes, samples=samples, baseline=f"raw {engine} {op}",
                       verified=verified, descriptors=round(statistics.median(moved)), params=params)


def _hidden(compute_s: float, seconds: float, push_s: float) -> dict[str, Any]:
    """A layer-wise row's extra params: how much of a whole push the layer-wise one hid behind the prefill."""
    hidden = round(min(1.0, max(0.0, 1 - seconds / push_s)), 3)
    return {
        "simulated_prefill_ms": round(compute_s * 1e3, 1), "push_ms": round(push_s * 1e3, 1), "hidden": hidden,
        "compute_over_push": round(compute_s / push_s, 3),
        "note": f"{seconds * 1e3:.0f} ms after prefill vs {push_s * 1e3:.0f} ms for a whole push: hidden {hidden:.2f}",
    }


def _name(engine: str, model: str, mode: Mode, pattern: Pattern) -> str:
    return f"pd-flow-{engine}-{model}-{mode}" + ("" if pattern == "scatter" else f"-{pattern}")


def scenario(
    engine: str, model: str, mode: Mode, pattern: Pattern = "scatter", layouts: LayoutChoice | None = None,
    variant: str = "", tokens: int | None = None, cross_layer: bool = False,
) -> Scenario:
    """One request through the disaggregation flow; ``layouts`` (default: the backend's) and a name ``variant``
    let a list add the same row over another layout; ``cross_layer`` allocates both caches as vLLM's one tensor
    for all layers; ``tokens`` overrides the size."""
    name = _name(engine, model, mode, pattern) + variant

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_flow(backend, engine, model, mode, quick, pattern, layouts, name, tokens, cross_layer)

    params = {"engine": engine, "model": model, "mode": mode, "pattern": pattern, "cross_layer": cross_layer}
    return Scenario(name, "pd", run, params, release=close_all)
