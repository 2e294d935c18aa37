"""P/D transfer scenarios (kind ``pd``): a peer process on 127.0.0.1 holds one instance's KV cache; this process
READs 16-token blocks from it or WRITEs them into it through kvplane (planner + transport), and through the raw
engine's own batch calls in the same run, one descriptor per block and layer slot (vLLM's per-layer blocks).

``-vram`` rows hold both caches in the backend's device memory, the peer's too (two processes on one device: on a
GPU, UCX's ``cuda_ipc``), and also time the raw engine moving kvplane's own descriptors (``raw_same_plan_ms``).

Caches are per-layer tensors (vLLM's default) or, for the ``-xl`` rows, vLLM's one cross-layer tensor on both
sides: then a block of every layer is one range and kvplane moves one descriptor per block, while the raw
baseline still moves one descriptor per block and layer (what the engine moves for vLLM's per-layer blocks).

Block ids are ``scatter`` (random) or ``runs`` (mostly consecutive, as a fresh request's are; the planner
coalesces them, the raw baseline does not). ``ratio`` is kvplane's speed over raw's (raw seconds over kvplane seconds). Bytes are verified once, right after
kvplane's first transfer (before the raw engine touches the same blocks), by comparing block digests.

NIXL rows move kvplane's plan through descriptor lists prepared once per peer (``make_prepped_xfer``); in the
same reps the same plan also moves unprepared (descriptor lists built per request, ``initialize_xfer``), shown
as ``unprepped_ms`` and ``prepped_speedup``. Cross-layer rows also time the raw engine moving kvplane's own
descriptors (``raw_same_plan_ms``): ``engine_gain`` (per-layer raw seconds over it) is what bigger descriptors are
worth to the engine itself, the ceiling of ``ratio``, and ``of_ceiling`` is how close kvplane comes.
``first_request_ms`` is kvplane's first transfer, which prepares the lists (``prep_ms``); ``prep_paths`` counts
the path each plan took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend
from kvplane.bench.block_ids import Pattern, per_block_plan, request_ids
from kvplane.bench.held import Held
from kvplane.bench.models import model_spec
from kvplane.bench.peer import CacheConfig, KVBuffer, PeerConfig, PeerProcess
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples, timed, timed_cpu
from kvplane.descriptors import CopyPlan
from kvplane.kv.manifest import Manifest
from kvplane.plan.planner import TransferPlan, plan_transfer
from kvplane.transports.base import Op, Transport, TransportConfig
from kvplane.transports.nixl import NixlTransport
from kvplane.transports.registry import get_transport_class

LayoutNames = str | Mapping[str, str]  # one layout name, or one per family (the peer takes names)
BLOCK_TOKENS = 16
TOKENS, QUICK_TOKENS = 10_000, 2_000
ENGINES = ("mooncake", "nixl")
MODELS = ("qwen3-0.6b", "deepseek-v3")


@dataclass
class _Pair:
    peer: PeerProcess
    local: KVBuffer
    transport: Transport
    handle: str

    def close(self) -> None:
        self.transport.close()
        self.peer.close()


_held: Held[_Pair] = Held(_Pair.close)  # one peer at a time, shared by the READ and WRITE rows of an engine and model


def _pair(
    backend: Backend, engine: str, model: str, tokens: int, layouts: LayoutNames | None, cross_layer: bool,
    vram: bool = False,
) -> _Pair:
    def build() -> _Pair:
        spec = model_spec(model, BLOCK_TOKENS)
        family = spec.layers[0].family
        layout = backend.layouts[family] if layouts is None else layouts if isinstance(layouts, str) else layouts[family]
        num_blocks = 2 * -(-tokens // BLOCK_TOKENS)
        peer = PeerProcess(PeerConfig(
            (CacheConfig(spec, layout, num_blocks, seed=1, engine_id="prefill", cross_layer=cross_layer),), engine,
            device=backend.name, device_memory=vram,
        ))
        local = KVBuffer(spec, layout, num_blocks, backend.alloc_device if vram else backend.alloc_host,
                         cross_layer=cross_layer)
        local.fill(2)
        transport = get_transport_class(engine)(backend, TransportConfig(timeout_s=120.0), agent_name="bench-decode")
        transport.register(backend.registration_spans(local.regions))
        return _Pair(peer, local, transport, transport.connect(peer.info))

    return _held.get((backend.label, engine, tokens, model, repr(layouts), cross_layer, vram), build)


def close_all() -> None:
    _held.release()


def run_pd(
    backend: Backend, engine: str, model: str, op: Op, quick: bool, pattern: Pattern = "scatter",
    layouts: LayoutNames | None = None, name: str | None = None, cross_layer: bool = False, vram: bool = False,
) -> BenchResult:
    tokens = QUICK_TOKENS if quick else TOKENS
    pair = _pair(backend, engine, model, tokens, layouts, cross_layer, vram)
    blocks = -(-tokens // BLOCK_TOKENS)
    rng = np.random.default_rng(7 if op == "READ" else 8)
    remote_ids = request_ids(pattern, 2 * blocks, blocks, rng)
    local_ids = request_ids(pattern, 2 * blocks, blocks, rng)
    local_manifest = pair.local.manifest("decode", 0, 1, backend.torch_device_type)
    start = time.perf_counter()
    tp, raw_plan = _plans(op, pair.peer.manifests[0], remote_ids, local_manifest, local_ids, tokens)
    plan_s = time.perf_counter() - start

    def ours() -> None:
        pair.transport.transfer(pair.handle, op, tp.plan)

    def raw() -> None:
        pair.transport.raw_move(pair.handle, op, raw_plan)

    nixl = pair.transport if isinstance(pair.transport, NixlTransport) else None
    if op == "WRITE":
        pair.peer.call("zero")
    first_s = timed(ours)
    verified = pair.local.digest(local_ids) == pair.peer.call("digest", block_ids=remote_ids.tolist())
    extra: dict[str, Callable[[], None]] = {}
    if nixl is not None:
        extra["unprepped"] = _unprepped(ours, nixl)
    if cross_layer or vram:  # the engine's own ceiling for kvplane's descriptors: what fewer, bigger ones buy
        extra["raw_same_plan"] = lambda: pair.transport.raw_move(pair.handle, op, tp.plan)
    samples, extra_s = _interleave_extra(ours, raw, extra)
    scenario = name or f"pd-{engine}-{model}-{op.lower()}" + ("" if pattern == "scatter" else f"-{pattern}")
    return make_result(scenario=scenario, kind="pd", backend=backend.label, transport=engine, nbytes=tp.plan.total_bytes,
                       samples=samples, baseline=f"raw {engine} batch calls", verified=verified,
                       descriptors=len(tp.plan),
                       params={
                           "model": model,
                           "op": op,
                           "mode": op.lower(),
                           "blocks_pattern": pattern,
                           "tokens": tokens,
                           "block_tokens": BLOCK_TOKENS,
                           "baseline_descriptors": len(raw_plan),
                           "plan_ms": round(plan_s * 1e3, 3),
                           "sides": "two processes on 127.0.0.1",
                           "cache": "cross-layer" if cross_layer else "per-layer",
                           "first_request_ms": round(first_s * 1e3, 1),
                           **(_prep_params(nixl, extra_s["unprepped"], samples.median) if nixl is not None else {}),
                           "memory": f"{backend.label} device memory, both processes" if vram else "host memory",
                           **(_ceiling_params(extra_s["raw_same_plan"], samples) if cross_layer or vram else {}),
                       })


def _plans(op: Op, remote: Manifest, remote_ids: npt.NDArray[np.int64], local: Manifest,
           local_ids: npt.NDArray[np.int64], tokens: int) -> tuple[TransferPlan, CopyPlan]:
    """kvplane's plan for ``op`` (READ: remote to local) and the baseline's one descriptor per block and region."""
    if op == "READ":
        return (plan_transfer(remote, local, {0: remote_ids}, {0: local_ids}, {0: tokens}),
                per_block_plan(remote.regions, remote_ids, local.regions, local_ids))
    return (plan_transfer(local, remote, {0: local_ids}, {0: remote_ids}, {0: tokens}),
            per_block_plan(local.regions, local_ids, remote.regions, remote_ids))


def _unprepped(ours: Callable[[], None], nixl: NixlTransport) -> Callable[[], None]:
    """kvplane's plan again with prepared lists off."""

    def plain() -> None:
        nixl.use_prepped = False
        try:
            ours()
        finally:
            nixl.use_prepped = True

    return plain


def _interleave_extra(ours: Callable[[], None], raw: Callable[[], None],
                      extra: Mapping[str, Callable[[], None]]) -> tuple[Samples, dict[str, list[float]]]:
    """``interleave``'s reps with one more run of each ``extra`` per rep, their wall seconds by name."""
    samples = Samples()
    seconds: dict[str, list[float]] = {name: [] for name in extra}
    for _ in range(MIN_REPS):
        wall, cpu = timed_cpu(ours)
        samples.add(wall, cpu, timed(raw))
        for name, run in extra.items():
            seconds[name].append(timed(run))
    return samples, seconds


def _ceiling_params(same_plan: list[float], samples: Samples) -> dict[str, object]:
    """The raw engine moving kvplane's own descriptors, beside kvplane and the per-layer baseline: ``engine_gain``
    is what the bigger descriptors are worth to the engine itself (the most ``ratio`` could reach), ``of_ceiling``
    how close kvplane comes to it."""
    ceiling_s = float(np.median(same_plan))
    gain = samples.baseline_median / ceiling_s if ceiling_s > 0 else 0.0
    of_ceiling = ceiling_s / samples.median if samples.median > 0 else 0.0
    return {
        "raw_same_plan_ms": round(ceiling_s * 1e3, 1),
        "engine_gain": round(gain, 3),
        "of_ceiling": round(of_ceiling, 3),
        "note": (f"the raw engine moving kvplane's descriptors: {ceiling_s * 1e3:.0f} ms, x{gain:.2f} its speed on "
                 f"per-layer blocks (what bigger descriptors give the engine itself); kvplane runs at {of_ceiling:.2f} "
                 f"of that"),
    }


def _prep_params(nixl: NixlTransport, unprepped: list[float], prepped_s: float) -> dict[str, object]:
    """What NIXL's prepared lists bought: the unprepared path's median beside the prepared one, and the paths
    the plans took (counted since the pair started)."""
    unprepped_s = float(np.median(unprepped))
    stats = nixl.prep_stats
    per = {k: v / n for k, v, n in (("prepped", stats.make_ms["prepped"], stats.prepped),
                                      ("unprepped", stats.make_ms["unprepped"], stats.unprepped)) if n}
    return {
        "make_ms_per_request": {k: round(v, 3) for k, v in per.items()},
        "unprepped_ms": round(unprepped_s * 1e3, 1),
        "prepped_speedup": round(unprepped_s / prepped_s, 3) if prepped_s > 0 else 0.0,
        "prep_ms": round(stats.prep_ms, 3),
        "prep_paths": stats.as_dict(),
    }


def scenario(
    engine: str, model: str, op: Op, pattern: Pattern = "scatter", layouts: LayoutNames | None = None,
    variant: str = "", cross_layer: bool = False, vram: bool = False,
) -> Scenario:
    """kvplane's transport moving one request between processes; ``layouts`` (default: the backend's) and a
    name ``variant`` let a list add the same row over another layout; ``cross_layer`` allocates both caches as
    vLLM's one tensor for all layers (the baseline still moves one descriptor per layer and block)."""
    name = (f"pd-{engine}-{model}-{op.lower()}" + ("" if pattern == "scatter" else f"-{pattern}") + variant
            + ("-vram" if vram else ""))

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_pd(backend, engine, model, op, quick, pattern, layouts, name, cross_layer, vram)

    params = {"engine": engine, "model": model, "op": op, "pattern": pattern, "cross_layer": cross_layer,
              "vram": vram}
    return Scenario(name, "pd", run, params, release=close_all)
