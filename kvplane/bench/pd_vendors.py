"""P/D across vendors (kind ``pd``, rows ``pd-vendors-*``): an Ascend-shaped prefill feeding a CUDA-shaped decode,
timed against a same-vendor pair in the same run.

The cross-vendor pair differs in everything at once. Its prefill is kvplane's Ascend backend over host memory
(``npu-emulated``) with vllm-ascend's caches: K and V (MLA's nope and rope) apart, 128-token blocks. Its decode is
the cpu backend wearing the cuda backend's facts (``cuda-emulated``, ``kvplane.testing.backends.host_stand_in``)
with vLLM's packed caches (MLA fused) and 16-token blocks. The same-vendor pair is two such CUDA-shaped ranks.
Both pairs run the disaggregation flow (``pd_flow.one_request``, two transport engines on 127.0.0.1, Mooncake on
``tcp`` for both, the one protocol both sides have here) with the same request: the row's baseline is the
same-vendor pair, so ``ratio`` is its time over the cross-vendor one (below 1: crossing vendors costs that much).

Where the layouts differ within a block (split against packed), the planner stages whole source blocks on the
decode and re-lays them out with tensor ops instead of emitting a descriptor per token; the row reports what that
costs: descriptors per request handed to the moving side's engine (``descriptors``, and ``same_vendor_descriptors``),
and ``staged_bytes``. ``verified``: every token of every slot equals the prefill's, read through each side's layout.
Emulated devices: these are figures of kvplane's code paths on this machine, never of Ascend or CUDA hardware.
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any

import numpy as np
import torch

from kvplane.backend.base import Backend
from kvplane.bench.block_ids import request_ids
from kvplane.bench.held import Held
from kvplane.bench.models import model_spec
from kvplane.bench.pd_flow import WAIT_S, Mode, Sides, one_request
from kvplane.bench.peer import KVBuffer
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples, timed_cpu
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import layouts_by_family
from kvplane.plan.planner import plan_transfer

BLOCK_TOKENS = {"npu-emulated": 128, "cuda-emulated": 16}  # vllm-ascend's and vLLM's CUDA default block sizes


def vendor_backends() -> tuple[Backend, Backend]:
    """The emulated npu and the CUDA-shaped stand-in (both labelled emulated)."""
    from kvplane_ascend.backend import AscendBackend
    from kvplane_cuda.backend import CudaBackend

    from kvplane.testing.backends import emulated_backend, host_stand_in

    return emulated_backend(AscendBackend)(), host_stand_in(CudaBackend)()


def _pair(prefill: Backend, decode: Backend, engine: str, model: str, tokens: int) -> Sides:
    """A prefill and a decode side on their own buffers (twice the request's blocks each); the decode stages a
    whole request where the layouts differ (a push stages it all at once)."""
    tag = uuid.uuid4().hex[:6]
    kvs = []
    for backend in (prefill, decode):
        spec = model_spec(model, BLOCK_TOKENS[backend.label])
        blocks = 2 * -(-tokens // BLOCK_TOKENS[backend.label])
        kvs.append(KVBuffer(spec, backend.layouts[spec.layers[0].family], blocks, backend.alloc_device))
    p_kv, d_kv = kvs
    p_kv.fill(1)
    common: dict[str, Any] = {"transport": engine, "transfer_timeout_s": WAIT_S, "push_timeout_s": WAIT_S,
                              "lease_s": WAIT_S, "port": 0, "protocol": "tcp" if engine == "mooncake" else ""}
    staging = d_kv.buffer.numel() if prefill.label != decode.label else 0
    side_p = PrefillSide(prefill, p_kv.spec, p_kv.cache, DisaggConfig(engine_id=f"bench-vp-{tag}", **common),
                         layouts=p_kv.layout)
    side_d = DecodeSide(decode, d_kv.spec, d_kv.cache,
                        DisaggConfig(engine_id=f"bench-vd-{tag}", staging_bytes=staging, **common), layouts=d_kv.layout)
    return Sides(side_p, side_d, p_kv, d_kv)


class _Pairs:
    def __init__(self, engine: str, model: str, tokens: int) -> None:
        npu, cuda = vendor_backends()
        self.cross = _pair(npu, cuda, engine, model, tokens)
        self.same = _pair(cuda, cuda, engine, model, tokens)

    def close(self) -> None:
        self.cross.close()
        self.same.close()


_held: Held[_Pairs] = Held(_Pairs.close)


def close_all() -> None:
    _held.release()


def token_rows(kv: KVBuffer, ids: np.ndarray, tokens: int) -> dict[tuple[str, str], torch.Tensor]:
    """Per (layer, slot) the request's first ``tokens`` as ``(tokens, heads, width)``, read through the layout."""
    by_family = layouts_by_family(kv.layout)
    index = torch.as_tensor(ids)
    out = {}
    for layer in kv.spec.layers:
        tokens_per_block = kv.spec.group(layer.group_id).tokens_per_block
        for st in by_family[layer.family].slot_tensors(layer, tokens_per_block, kv.cache[layer.name]):
            rows = st.tensor.index_select(0, index).reshape(-1, st.heads, st.row_elems)[:tokens]
            for name, offset, width in st.parts:
                out[(layer.name, name)] = rows[..., offset : offset + width]
    return out


def _same_tokens(sides: Sides, p_ids: np.ndarray, d_ids: np.ndarray, tokens: int) -> bool:
    got, want = token_rows(sides.d_kv, d_ids, tokens), token_rows(sides.p_kv, p_ids, tokens)
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


def run(engine: str, model: str, mode: Mode, tokens: int, name: str) -> BenchResult:
    pairs = _held.get((engine, model, tokens), lambda: _Pairs(engine, model, tokens))
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
        "model": model, "mode": mode, "tokens": tokens, "emulated": True,
        "prefill": f"npu-emulated {p_man.layouts}, {BLOCK_TOKENS['npu-emulated']}-token blocks",
        "decode": f"cuda-emulated {d_man.layouts}, {BLOCK_TOKENS['cuda-emulated']}-token blocks",
        "same_vendor": "cuda-emulated both sides", "protocol": "tcp" if engine == "mooncake" else "UCX",
        "staged_bytes": plan.staged_bytes, "direct_bytes": plan.direct_bytes, "plan_descriptors": len(plan.plan),
        "same_vendor_descriptors": round(statistics.median(same_descs)),
        "cross_ms": round(samples.median * 1e3, 1), "same_vendor_ms": round(samples.baseline_median * 1e3, 1),
    }
    return make_result(
        scenario=name, kind="pd", backend="npu-emulated -> cuda-emulated", transport=engine,
        nbytes=plan.staged_bytes + plan.direct_bytes, samples=samples, baseline="same-vendor pair (cuda-emulated)",
        verified=verified, descriptors=round(statistics.median(cross_descs)), params=params,
    )


def scenario(engine: str, model: str, mode: Mode, tokens: int) -> Scenario:
    """The cross-vendor pair against the same-vendor one, one request of ``tokens`` each; the runner's backend is
    not used (both pairs run on emulated devices, whatever ``KVPLANE_DEVICE`` says)."""
    name = f"pd-vendors-{engine}-{model}-{mode}"
    params = {"engine": engine, "model": model, "mode": mode, "tokens": tokens}
    return Scenario(name, "pd", lambda _backend, _quick: run(engine, model, mode, tokens, name), params,
                    release=close_all)
