"""Offload-engine scenarios (kind ``offload``): a request's KV through ``OffloadEngine``'s full path against a
contiguous ``copy_`` of the same bytes in the same run.

The device cache is per-layer tensors, or (``cross_layer``, the ``-xl`` rows) vLLM's one tensor for all layers.
10k tokens (2k with ``--quick``) in scattered 16-token blocks of a device cache twice that size. ``store`` times
``start_store`` + ``save_layer`` per layer + ``wait_for_save`` + ``get_finished`` (events, copy stream, host
pool, prefix index); every rep stores a fresh prefix, so the host tier evicts the previous one, as in steady
state. ``load`` times ``start_load`` + ``wait_for_layer`` per layer + ``get_finished`` of a prefix the host tier
holds. Bytes are compared after a store and a load (device blocks in, device blocks out), once per rig: the
store and load rows of a model share the rig and the comparison. Each baseline ``copy_`` is followed by an
untimed pause (``SETTLE_S``), so torch's OpenMP worker, still spinning after it, does not take a core from
kvplane's next rep.

The load scenario also measures overlap: a forward with a simulated compute of ``load time / layers`` per layer
(a sleep: like device compute it leaves the CPU to the copies), run layer-wise (``wait_for_layer`` before each
layer's compute) and serially (the whole load, then every layer's compute). ``params["overlap_hidden"]`` is the
fraction of the load time the layer-wise run hid, ``(serial - layerwise) / load``; with copy and compute of
equal length the best a pipeline can do is ``(layers - 1) / layers``.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend
from kvplane.bench.held import Held
from kvplane.bench.local_copy import SETTLE_S, same_blocks
from kvplane.bench.models import model_spec
from kvplane.bench.peer import cross_layer_cache
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, interleave, timed
from kvplane.blocks import block_hashes
from kvplane.flows.offload import OffloadConfig, OffloadEngine, StoreConfig
from kvplane.kv.binding import LayoutChoice, allocate_cache, slot_tensors
from kvplane.kv.bound import bind
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec

if TYPE_CHECKING:
    import torch

BLOCK_TOKENS = 16
TOKENS, QUICK_TOKENS = 10_000, 2_000
GROUP = 0
FILL_FACTOR = 0x9E3779B1  # an odd multiplier: word i holds i * FILL_FACTOR


@dataclass
class OffloadRig:
    """A device cache with a distinct pattern, an engine whose host tier holds one request, and flat buffers
    of the request's bytes for the baseline. ``close`` stops the engine's copy streams."""

    spec: KVSpec
    cache: dict[str, LayerValue]
    engine: OffloadEngine
    src_ids: npt.NDArray[np.int64]  # the request's device blocks (scattered)
    dst_ids: npt.NDArray[np.int64]  # where loads put them (scattered, disjoint from src_ids)
    nbytes: int
    flat_device: torch.Tensor
    flat_host: torch.Tensor
    prefixes: Iterator[list[int]]  # a fresh prefix for every store
    layouts: LayoutChoice
    round_trip: bool | None = None  # a stored prefix loaded back byte for byte (None: not compared yet)

    def close(self) -> None:
        self.engine.close()

    def descriptors(self, hashes: list[int], direction: str) -> int:
        """Copy descriptors the engine hands its backend for one store or load of ``hashes`` (held on host)."""
        host_ids = self.engine.index.blocks_of(GROUP, hashes)
        layers = self.spec.layer_names
        copier = self.engine.copier
        if direction == "store":
            return len(copier.save_parts(layers, self.src_ids, host_ids)[0])
        return len(copier.load_parts(layers, host_ids, self.dst_ids)[0])


def build_rig(
    backend: Backend, model: str, tokens: int, host_blocks_factor: int = 1, store: StoreConfig | None = None,
    layouts: LayoutChoice | None = None, fill: bool = True, cross_layer: bool = False,
) -> OffloadRig:

    layouts = backend.layouts if layouts is None else layouts
    spec = model_spec(model, BLOCK_TOKENS)
    blocks = -(-tokens // BLOCK_TOKENS)
    total = 2 * blocks
    per_block = spec.bytes_per_token * BLOCK_TOKENS
    device = backend.alloc_device(total * per_block)
    if fill:  # distinct int64 words everywhere, so a misplaced block cannot compare equal
        fill_distinct(device, per_block // 8)
    if cross_layer:
        cache = cross_layer_cache(spec, layouts, total, lambda n: device[:n], "NHD")[1]
    else:
        cache = allocate_cache(spec, layouts, total, alloc=lambda n: device[:n], zero=False)
    engine = OffloadEngine(bind(backend, spec, cache, layouts),
                           OffloadConfig(host_blocks_factor * blocks * per_block, store))
    order = np.random.default_rng(tokens).permutation(total).astype(np.int64)
    nbytes = blocks * per_block
    flat_device, flat_host = backend.alloc_device(nbytes), backend.alloc_host(nbytes)
    flat_device.fill_(1)
    flat_host.zero_()
    token_ids = np.arange(tokens, dtype=np.int64)
    prefixes = (block_hashes(token_ids, BLOCK_TOKENS, parent=seed) for seed in itertools.count(1))
    backend.synchronize()
    settle_gc()
    return OffloadRig(
        spec, cache, engine, order[:blocks], order[blocks:], nbytes, flat_device, flat_host, prefixes, layouts
    )


def fill_distinct(buffer: torch.Tensor, row_words: int) -> None:
    """Word ``i`` of ``buffer`` (int64 words) becomes ``i * FILL_FACTOR``: distinct everywhere, so a misplaced
    block never compares equal. Written in one parallel pass as rows of ``row_words`` (a multiple of the
    buffer's words): ``(r * row_words + c) * F == r * row_words * F + c * F`` in int64's wrap-around arithmetic,
    where ``arange`` then ``mul_`` took two passes, the first on one thread."""
    import torch

    words = buffer.view(torch.int64)
    if row_words <= 0 or words.numel() % row_words:
        raise ValueError(f"fill_distinct: row_words={row_words} must divide the buffer's {words.numel()} words")
    rows = words.numel() // row_words
    # on the buffer's device: torch.add refuses a CPU operand for a GPU out= (seen on the first GPU run)
    starts = torch.arange(rows, dtype=torch.int64, device=words.device).mul_(row_words * FILL_FACTOR)
    steps = torch.arange(row_words, dtype=torch.int64, device=words.device).mul_(FILL_FACTOR)
    torch.add(starts[:, None], steps[None, :], out=words.view(rows, row_words))


def settle_gc() -> None:
    """Collect, then move everything alive into the permanent generation (as vLLM does after start-up), so a
    full collection of the torch import's objects does not land inside a timed rep of the path under test."""
    gc.collect()
    gc.freeze()


class _Ids:
    def __init__(self, prefix: str) -> None:
        self._counter = itertools.count()
        self._prefix = prefix

    def __call__(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"


def store_once(rig: OffloadRig, request_id: str, hashes: list[int]) -> int:
    """One request's store through the engine, as a forward drives it; returns the blocks copied."""
    engine = rig.engine
    n = engine.start_store(request_id, hashes, rig.src_ids)
    for name in rig.spec.layer_names:
        engine.save_layer(name)
    engine.wait_for_save()
    stored, _ = engine.get_finished()
    if request_id not in stored:
        raise RuntimeError(f"bench: store {request_id!r} did not finish after wait_for_save")
    return n


def load_once(rig: OffloadRig, request_id: str, hashes: list[int], compute_s: float = 0.0) -> int:
    """One request's load, waiting layer by layer (and computing ``compute_s`` per layer after each wait)."""
    engine = rig.engine
    tokens = engine.start_load(request_id, hashes, rig.dst_ids)
    for name in rig.spec.layer_names:
        engine.wait_for_layer(name)
        if compute_s:
            time.sleep(compute_s)
    # wait_for_layer orders the compute stream after the layer's copy; the forward's last layer runs on it
    engine.backend.current_stream().synchronize()
    _, loaded = engine.get_finished()
    if request_id not in loaded:  # every layer's event is done, so its pins must be released now
        raise RuntimeError(f"bench: load {request_id!r} was not reported finished after its last layer")
    return tokens


def load_then_compute(rig: OffloadRig, request_id: str, hashes: list[int], compute_s: float) -> None:
    """The serial reference: the whole load first, then every layer's compute."""
    engine = rig.engine
    engine.start_load(request_id, hashes, rig.dst_ids)
    for name in rig.spec.layer_names:
        engine.wait_for_layer(name)
    engine.backend.current_stream().synchronize()  # the load is done (wait_for_layer does not block the host)
    engine.get_finished()
    for _ in rig.spec.layer_names:
        time.sleep(compute_s)


def _zero_dst(rig: OffloadRig) -> None:
    import torch

    ids = torch.from_numpy(rig.dst_ids)
    for slot in slot_tensors(rig.spec, rig.cache, rig.layouts):
        slot.tensor.index_fill_(0, ids.to(slot.tensor.device), 0)
    rig.engine.backend.synchronize()


def _verify(rig: OffloadRig, hashes: list[int], new_id: Callable[[], str]) -> bool:
    """The stored prefix loads back into other device blocks byte for byte."""
    _zero_dst(rig)
    tokens = load_once(rig, new_id(), hashes)
    if tokens != len(hashes) * BLOCK_TOKENS:
        return False
    return same_blocks(rig.spec, rig.cache, rig.src_ids, rig.cache, rig.dst_ids, rig.layouts)


def _round_trip(rig: OffloadRig, hashes: list[int], new_id: Callable[[], str]) -> bool:
    """The rig's store-then-load comparison, made once: the load row reuses the store row's (the same engine,
    blocks and path), which saves a full compare of the request's bytes per model; run alone, a row makes it."""
    if rig.round_trip is None:
        rig.round_trip = _verify(rig, hashes, new_id)
    return rig.round_trip


_held: Held[OffloadRig] = Held(OffloadRig.close)  # the last model's rig: store and load share it


def _rig(
    backend: Backend, model: str, tokens: int, layouts: LayoutChoice | None, fill: bool = True,
    cross_layer: bool = False,
) -> OffloadRig:
    key = (backend.label, model, tokens, repr(layouts), fill, id(backend), cross_layer)
    return _held.get(key, lambda: build_rig(backend, model, tokens, layouts=layouts, fill=fill,
                                            cross_layer=cross_layer))


def _release() -> None:
    _held.release()


def _params(backend: Backend, rig: OffloadRig, model: str, direction: str, tokens: int) -> dict[str, object]:
    return {
        "model": model, "direction": direction, "block_tokens": BLOCK_TOKENS, "tokens": tokens,
        "blocks": len(rig.src_ids), "layers": len(rig.spec.layer_names), "torch_device": str(backend.device()),
    }


def run_offload(
    backend: Backend, model: str, direction: str, quick: bool, layouts: LayoutChoice | None = None,
    name: str | None = None, cross_layer: bool = False,
) -> BenchResult:
    tokens = QUICK_TOKENS if quick else TOKENS
    rig = _rig(backend, model, tokens, layouts, cross_layer=cross_layer)
    new_id = _Ids(f"bench-{model}-{direction}")
    params = _params(backend, rig, model, direction, tokens)
    params["cache"] = "cross-layer" if cross_layer else "per-layer"
    hashes = next(rig.prefixes)
    if direction == "store":
        copied = store_once(rig, new_id(), hashes)
        verified = copied == len(rig.src_ids) and _round_trip(rig, hashes, new_id)

        fresh = iter([next(rig.prefixes) for _ in range(2 * MIN_REPS)])  # hashed before timing: not kvplane's

        def ours() -> None:
            store_once(rig, new_id(), next(fresh))

        def raw() -> None:
            rig.flat_host.copy_(rig.flat_device)
            backend.synchronize()
    else:
        store_once(rig, new_id(), hashes)
        verified = _round_trip(rig, hashes, new_id)

        def ours() -> None:
            load_once(rig, new_id(), hashes)

        def raw() -> None:
            rig.flat_device.copy_(rig.flat_host)
            backend.synchronize()

    descriptors = rig.descriptors(hashes, direction)
    samples = interleave(ours, raw, settle_s=SETTLE_S)
    if direction == "load":
        params.update(overlap(rig, hashes, samples.median, new_id))
        params["note"] = (f"load hidden behind layer compute: {params['overlap_hidden']:.2f} "
                          f"(at most {params['overlap_best']:.2f})")
        _release()  # load runs after store for each model: the buffers go before the next scenario
    return make_result(scenario=name or f"offload-{model}-{direction}", kind="offload", backend=backend.label,
                       transport="local", nbytes=rig.nbytes, samples=samples, baseline="contiguous copy_",
                       verified=verified, descriptors=descriptors, params=params)


def overlap(rig: OffloadRig, hashes: list[int], load_s: float, new_id: Callable[[], str]) -> dict[str, float]:
    """How much of the load a layer-wise forward hides behind a per-layer compute of ``load_s / layers``."""
    compute_s = load_s / len(rig.spec.layer_names)

    def layer_by_layer() -> None:
        load_once(rig, new_id(), hashes, compute_s)

    def load_first() -> None:
        load_then_compute(rig, new_id(), hashes, compute_s)

    layerwise, serial = [], []
    for _ in range(MIN_REPS):
        layerwise.append(timed(layer_by_layer))
        serial.append(timed(load_first))
    lw, se = statistics.median(layerwise), statistics.median(serial)
    hidden = max(0.0, min(1.0, (se - lw) / load_s)) if load_s > 0 else 0.0
    return {
        "compute_per_layer_ms": round(compute_s * 1e3, 3),
        "layerwise_s": round(lw, 4),
        "serial_s": round(se, 4),
        "overlap_hidden": round(hidden, 3),
        "overlap_best": round((len(rig.spec.layer_names) - 1) / len(rig.spec.layer_names), 3),
    }


def scenario(
    model: str, direction: str, layouts: LayoutChoice | None = None, variant: str = "", cross_layer: bool = False
) -> Scenario:
    """One request's store or load through ``OffloadEngine``; ``layouts`` (default: the backend's) and a name
    ``variant`` let a list add the same row over another layout; ``cross_layer`` allocates the device cache as
    vLLM's one tensor for all layers."""
    name = f"offload-{model}-{direction}{variant}"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_offload(backend, model, direction, quick, layouts, name, cross_layer)

    params = {"model": model, "direction": direction, "cross_layer": cross_layer}
    return Scenario(name, "offload", run, params, release=_release)
