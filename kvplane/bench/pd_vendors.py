"""P/D between two vendors' cache shapes (kind ``pd``, rows ``pd-vendors-*``): a prefill holding vllm-ascend's
caches feeding a decode holding vLLM's CUDA caches, timed against a same-vendor pair in the same run.

The cross-vendor pair differs in every cache fact at once: its prefill holds the Ascend backend's layouts (K and V,
MLA's nope and rope, apart) in 128-token blocks, its decode the cuda backend's (packed; MLA fused) in 16-token
blocks, both read from the installed backend classes through the registry (device facts, never a device). The
same-vendor pair is two CUDA-shaped ranks. Both pairs run on the runner's backend (host memory and the cpu copy
path on this machine; device memory on a GPU) through the disaggregation flow (``pd_flow.one_request``, two
transport engines on 127.0.0.1) with the same request: the row's baseline is the same-vendor pair, so ``ratio`` is
its time over the cross-vendor one (below 1: crossing vendors costs that much). The devices themselves, registration
rules included, are crossed by the emulated-device tests (``tests/disagg/test_pd_cross_vendor.py``), not here.

Where the layouts differ within a block (split against packed), the planner stages whole source blocks on the
decode and re-lays them out with tensor ops instead of emitting a descriptor per token; the row reports what that
costs: descriptors per request handed to the moving side's engine (``descriptors``, and ``same_vendor_descriptors``),
and ``staged_bytes``. ``verified``: every token of every slot equals the prefill's, read through each side's layout.
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any

import numpy as np
import torch

from kvplane.backend.base import Backend
from kvplane.backend.registry import default_registry
from kvplane.bench.block_ids import request_ids
from kvplane.bench.held import Held
from kvplane.bench.models import model_spec
from kvplane.bench.pd_flow import WAIT_S, Mode, Sides, one_request
from kvplane.bench.peer import KVBuffer
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples, timed_cpu
from kvplane.errors import KvplaneError
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import token_rows
from kvplane.kv.bound import bind
from kvplane.plan.planner import plan_transfer

VENDORS = {"npu": 128, "cuda": 16}  # the backends whose cache facts the pairs take, and their engines' block sizes


def vendor_layouts(name: str) -> dict[str, str]:
    """The layouts of backend ``name``, read from its installed class (a device fact; nothing is probed)."""
    registry = default_registry()
    cls = registry.load(name)
    if cls is None:
        raise KvplaneError(f"the {name} backend package does not load ({registry.error(name)}); the cross-vendor rows "
                           f"take its layouts: pip install -e backends/{'ascend' if name == 'npu' else name}")
    return dict(cls.layouts)


def _pair(backend: Backend, prefill: str, decode: str, engine: str, model: str, tokens: int) -> Sides:
    """A prefill of ``prefill``'s cache shapes and a decode of ``decode``'s on their own buffers (twice the request's
    blocks each); the decode stages a whole request where the layouts differ (a push stages it all at once)."""
    tag = uuid.uuid4().hex[:6]
    kvs = []
    for vendor in (prefill, decode):
        spec = model_spec(model, VENDORS[vendor])
        blocks = 2 * -(-tokens // VENDORS[vendor])
        layout = vendor_layouts(vendor)[spec.layers[0].family]
        kvs.append(KVBuffer(spec, layout, blocks, backend.alloc_device))
    p_kv, d_kv = kvs
    p_kv.fill(1)
    common: dict[str, Any] = {"transport": engine, "transfer_timeout_s": WAIT_S, "push_timeout_s": WAIT_S,
                              "lease_s": WAIT_S, "port": 0}
    staging = d_kv.buffer.numel() if prefill != decode else 0
    side_p = PrefillSide(bind(backend, p_kv.spec, p_kv.cache, p_kv.layout),
                         DisaggConfig(engine_id=f"bench-vp-{tag}", **common))
    side_d = DecodeSide(bind(backend, d_kv.spec, d_kv.cache, d_kv.layout),
                        DisaggConfig(engine_id=f"bench-vd-{tag}", staging_bytes=staging, **common))
    return Sides(side_p, side_d, p_kv, d_kv)


class _Pairs:
    def __init__(self, backend: Backend, engine: str, model: str, tokens: int) -> None:
        self.cross = _pair(backend, "npu", "cuda", engine, model, tokens)
        self.same = _pair(backend, "cuda", "cuda", engine, model, tokens)

    def close(self) -> None:
        self.cross.close()
        self.same.close()


_held: Held[_Pairs] = Held(_Pairs.close)


def close_all() -> None:
    _held.release()


def _same_tokens(sides: Sides, p_ids: np.ndarray, d_ids: np.ndarray, tokens: int) -> bool:
    got, want = (token_rows(kv.spec, kv.cache, kv.layout, {0: ids.tolist()}, tokens)
                 for kv, ids in ((sides.d_kv, d_ids), (sides.p_kv, p_ids)))
    def raw(t: torch.Tensor) -> torch.Tensor:  # bits, not values: the fill's words hold NaNs
        return t.contiguous().view(torch.uint8)

    return got.keys() == want.keys() and all(torch.equal(raw(got[k]), raw(want[k])) for k in want)


def _ids(sides: Sides, tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for kv in (sides.p_kv, sides.d_kv):
        n = -(-tokens // kv.spec.groups[0].tokens_per_block)
        out.append(request_ids("scatter", 2 * n, n, rng))
    return out[0], out[1]


def _moved(sides: Sides, mode: Mode, p_ids: np.ndarray, d_ids: np.ndarray, tokens: int) -> tuple[float, int]:
    """One request; its seconds from prefill done to KV ready, and the descriptors its moving side submitted."""
    mover = (sides.decode if mode == "pull" else sides.prefill).local.transport
    before = mover.submitted.descriptors
    seconds = one_request(sides, mode, p_ids, d_ids, tokens, 0.0)
    return seconds, mover.submitted.descriptors - before


def run(backend: Backend, engine: str, model: str, mode: Mode, tokens: int, name: str) -> BenchResult:
    pairs = _held.get((backend.label, engine, model, tokens), lambda: _Pairs(backend, engine, model, tokens))
    rng = np.random.default_rng(21)
    (cp, cd), (sp, sd) = _ids(pairs.cross, tokens, rng), _ids(pairs.same, tokens, rng)
    for sides, (p_ids, d_ids) in ((pairs.cross, (cp, cd)), (pairs.same, (sp, sd))):
        sides.d_kv.buffer.zero_()
        _moved(sides, mode, p_ids, d_ids, tokens)  # also the handshake, which is not timed again
    verified = _same_tokens(pairs.cross, cp, cd, tokens) and _same_tokens(pairs.same, sp, sd, tokens)
    samples, cross_descs, same_descs = Samples(), [], []
    for _ in range(MIN_REPS):  # interleaved, so the machine's load falls on both pairs alike
        moved: list[tuple[float, int]] = []
        _, cpu = timed_cpu(lambda: moved.append(_moved(pairs.cross, mode, cp, cd, tokens)))  # noqa: B023
        samples.ours.append(moved[0][0])
        samples.cpu.append(cpu)
        cross_descs.append(moved[0][1])
        seconds, descs = _moved(pairs.same, mode, sp, sd, tokens)
        samples.baseline.append(seconds)
        same_descs.append(descs)
    p_man, d_man = pairs.cross.prefill.local.manifest, pairs.cross.decode.local.manifest
    plan = plan_transfer(p_man, d_man, {0: cp}, {0: cd}, {0: tokens}, staging=(0, 1 << 62))
    params: dict[str, Any] = {
        "model": model, "mode": mode, "tokens": tokens,
        "prefill": f"Ascend's caches {p_man.layouts}, {VENDORS['npu']}-token blocks",
        "decode": f"CUDA's caches {d_man.layouts}, {VENDORS['cuda']}-token blocks",
        "same_vendor": "CUDA's caches on both sides",
        "staged_bytes": plan.staged_bytes, "direct_bytes": plan.direct_bytes, "plan_descriptors": len(plan.plan),
        "same_vendor_descriptors": round(statistics.median(same_descs)),
        "cross_ms": round(samples.median * 1e3, 1), "same_vendor_ms": round(samples.baseline_median * 1e3, 1),
    }
    return make_result(scenario=name, kind="pd", backend=backend.label, transport=engine,
                       nbytes=plan.staged_bytes + plan.direct_bytes, samples=samples,
                       baseline="same-vendor pair (CUDA's caches)", verified=verified,
                       descriptors=round(statistics.median(cross_descs)), params=params)


def scenario(engine: str, model: str, mode: Mode, tokens: int) -> Scenario:
    """The cross-vendor pair against the same-vendor one, one request of ``tokens`` each, on the runner's backend."""
    name = f"pd-vendors-{engine}-{model}-{mode}"
    params = {"engine": engine, "model": model, "mode": mode, "tokens": tokens}
    return Scenario(name, "pd", lambda backend, _quick: run(backend, engine, model, mode, tokens, name), params,
                    release=close_all)
