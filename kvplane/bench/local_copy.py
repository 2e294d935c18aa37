"""Local-copy scenarios (kind ``offload``): scattered KV blocks device -> host and back, against a contiguous
``copy_`` of the same bytes in the same run.

The source cache is twice the request's size and the request's blocks are a random subset, on both sides, as
a real block table is. Bytes are compared after the first copy. The cache's layout is the one this backend's
engines use (its ``layouts`` attribute).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvplane.backend.base import Backend, Direction
from kvplane.bench.descriptor_sweep import route_of
from kvplane.bench.models import model_spec
from kvplane.bench.peer import cross_layer_cache
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import interleave
from kvplane.kv.binding import LayoutChoice, allocate_cache, regions_from_tensors, slot_tensors
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec
from kvplane.plan.local import block_copy_plan

if TYPE_CHECKING:
    import torch

# An untimed pause after each baseline copy_, before kvplane's next rep: torch's OpenMP worker spins 10-13 ms of
# CPU after a parallel copy_ (measured here), which on 2 cores takes one of the two cores kvplane's copy threads
# need. The baseline's own time is unchanged; kvplane's copy threads block instead of spinning, so they leave
# the baseline nothing to pay.
SETTLE_S = 0.03

BLOCK_TOKENS = (16, 32, 64, 128)
TOKENS, QUICK_TOKENS = 10_000, 2_000


@dataclass
class _Buffers:
    key: tuple[str, str, int]
    device: torch.Tensor
    host: torch.Tensor
    flat_src: torch.Tensor
    flat_dst: torch.Tensor


_held: list[_Buffers] = []  # buffers of the last model, reused across block sizes and directions


def release() -> None:
    """Drop the held buffers (the runner calls it before another module's rows)."""
    _held.clear()


def _buffers(backend: Backend, model: str, tokens: int) -> _Buffers:
    import torch

    key = (backend.label, model, tokens)
    if _held and _held[0].key == key:
        return _held[0]
    _held.clear()
    padded = -(-tokens // max(BLOCK_TOKENS)) * max(BLOCK_TOKENS)  # every block size's cache fits
    nbytes = 2 * padded * model_spec(model, 16).bytes_per_token
    device = backend.alloc_device(nbytes)
    # distinct int64 words everywhere, so a misplaced block cannot compare equal
    device.view(torch.int64).copy_(torch.arange(nbytes // 8, dtype=torch.int64, device=device.device) * 0x9E3779B1)
    host = backend.alloc_host(nbytes)
    need = tokens * model_spec(model, 16).bytes_per_token
    flat_src = backend.alloc_device(need)
    flat_dst = backend.alloc_host(need)
    flat_src.fill_(1)
    flat_dst.zero_()
    _held.append(_Buffers(key, device, host, flat_src, flat_dst))
    return _held[0]


def _prefix_of(buf: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda n: buf[:n]


def _caches(bufs: _Buffers, spec: KVSpec, layouts: LayoutChoice, total_blocks: int, direction: str,
            cross_layer: bool) -> dict[str, dict[str, LayerValue]]:
    """Both sides' caches carved from the held buffers, the source side holding the distinct pattern and the
    destination side zeros."""
    carve = {"device": bufs.device, "host": bufs.host}
    if cross_layer:  # vLLM's one tensor for all layers on both sides: a block of every layer is one range
        caches = {side: cross_layer_cache(spec, layouts, total_blocks, _prefix_of(buf), "NHD")[1]
                  for side, buf in carve.items()}
    else:
        caches = {side: allocate_cache(spec, layouts, total_blocks, alloc=_prefix_of(buf), zero=False)
                  for side, buf in carve.items()}
    if direction == "h2d":  # give the host side the distinct pattern, the device side zeros
        bufs.host.copy_(bufs.device.to(bufs.host.device))
    carve["host" if direction == "d2h" else "device"].zero_()
    return caches


def run_local_copy(
    backend: Backend, model: str, direction: str, block_tokens: int, quick: bool,
    layouts: LayoutChoice | None = None, name: str | None = None, cross_layer: bool = False,
) -> BenchResult:
    tokens = QUICK_TOKENS if quick else TOKENS
    spec = model_spec(model, block_tokens)
    layouts = backend.layouts if layouts is None else layouts
    bufs = _buffers(backend, model, tokens)
    blocks = -(-tokens // block_tokens)
    total_blocks = 2 * blocks
    caches = _caches(bufs, spec, layouts, total_blocks, direction, cross_layer)
    src_side, dst_side = ("device", "host") if direction == "d2h" else ("host", "device")
    rng = np.random.default_rng(block_tokens)
    src_ids = rng.choice(total_blocks, blocks, replace=False)
    dst_ids = rng.choice(total_blocks, blocks, replace=False)
    src_regions = regions_from_tensors(spec, caches[src_side], layouts)
    dst_regions = regions_from_tensors(spec, caches[dst_side], layouts)
    plan = block_copy_plan(src_regions, src_ids, dst_regions, dst_ids)
    stream, event = backend.new_stream(), backend.new_event()
    kind: Direction = "d2h" if direction == "d2h" else "h2d"
    backend.synchronize()  # the fills and zero_ above ran on the compute stream; the copy stream does not wait

    def ours() -> None:
        backend.execute(plan, stream, direction=kind)
        event.record(stream)
        event.synchronize()

    ours()
    verified = same_blocks(spec, caches[src_side], src_ids, caches[dst_side], dst_ids, layouts)
    nbytes = plan.total_bytes
    src_flat, dst_flat = (bufs.flat_src, bufs.flat_dst) if direction == "d2h" else (bufs.flat_dst, bufs.flat_src)

    def raw() -> None:
        dst_flat[:nbytes].copy_(src_flat[:nbytes])
        backend.synchronize()

    samples = interleave(ours, raw, settle_s=SETTLE_S)
    return make_result(scenario=name or f"copy-{model}-{direction}-bs{block_tokens}", kind="offload",
                       backend=backend.label, transport="local", nbytes=nbytes, samples=samples,
                       baseline="contiguous copy_", verified=verified, descriptors=len(plan),
                       params={
                           "model": model,
                           "direction": direction,
                           "block_tokens": block_tokens,
                           "tokens": tokens,
                           "blocks": blocks,
                           "descriptors": len(plan),
                           "torch_device": str(backend.device()),
                           "cache": "cross-layer" if cross_layer else "per-layer",
                           "route": route_of(backend, plan, kind),
                       })


def same_blocks(
    spec: KVSpec,
    src: dict[str, LayerValue],
    src_ids: npt.NDArray[np.int64],
    dst: dict[str, LayerValue],
    dst_ids: npt.NDArray[np.int64],
    layouts: LayoutChoice,
) -> bool:
    """Every slot of block ``src_ids[i]`` equals the same slot of block ``dst_ids[i]``, byte for byte."""
    import torch

    s_ids, d_ids = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
    for s, d in zip(slot_tensors(spec, src, layouts), slot_tensors(spec, dst, layouts)):
        a = s.tensor.index_select(0, s_ids.to(s.tensor.device)).cpu()
        b = d.tensor.index_select(0, d_ids.to(d.tensor.device)).cpu()
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return False
    return True


def scenario(model: str, direction: str, block_tokens: int, layouts: LayoutChoice | None = None,
             variant: str = "", cross_layer: bool = False) -> Scenario:
    """A block copy plan of ``model``'s KV in ``block_tokens``-token blocks; ``layouts`` (default: the
    backend's) and a name ``variant`` let a list add the same row over another layout; ``cross_layer`` carves
    both caches as vLLM's one tensor for all layers."""
    name = f"copy-{model}-{direction}-bs{block_tokens}{variant}"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_local_copy(backend, model, direction, block_tokens, quick, layouts, name, cross_layer)

    params = {"model": model, "direction": direction, "block_tokens": block_tokens, "cross_layer": cross_layer}
    return Scenario(name, "offload", run, params, release=release)
