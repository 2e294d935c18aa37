"""Engine-call latency during a transfer (kind ``calls``): how long ``get_finished`` takes on the engine's thread
while a large P/D transfer is in flight, against the same call with nothing in flight.

A ``PrefillSide`` and a ``DecodeSide`` run in this process on 127.0.0.1 (Mooncake TE or NIXL); each rep, the
decode pulls one request of ``mib`` MiB (2 GiB in ``--full``, as issue 12 asks; 256 MiB with ``--quick``) and
the engine thread calls ``get_finished()`` on both sides, 1 ms apart (an engine step's other work), until the
request is reported; then it makes as many calls with nothing in flight. A rep's figure is the p99 of its calls
on each side (in flight: kvplane; idle: the baseline), so ``ratio`` is idle p99 over in-flight p99: 1.0 means a
transfer does not slow the engine's calls at all. ``params`` pools every call of the row: ``p50_ms``, ``p99_ms``
and ``max_ms`` in flight (the goal is p99 under 5 ms), the idle ones, and the calls made. ``cpu_seconds`` is the
engine thread's CPU time per call. The pulled bytes are compared with the prefill's after the first rep.

Also a script: ``python -m kvplane.bench.engine_calls --engine nixl --mib 1024`` prints one JSON line per engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvplane.backend.base import Backend
from kvplane.bench.held import Held
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples
from kvplane.errors import KvplaneError
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec

if TYPE_CHECKING:
    import torch

SPEC = KVSpec.gqa(8, 8, 128, tokens_per_block=16)  # 32 KiB per token (bf16), 512 KiB per 16-token block
TOKEN_BYTES = 32 * 1024
BLOCK_TOKENS = 16
FULL_MIB, QUICK_MIB = 2048, 256
GOAL_P99_S = 5e-3
STEP_S = 0.001  # between calls: an engine step's other work
WAIT_S = 300.0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


@dataclass
class _Pair:
    prefill: PrefillSide
    decode: DecodeSide
    p_cache: dict[str, LayerValue]
    d_cache: dict[str, LayerValue]
    blocks: int

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def _tensors(cache: dict[str, LayerValue]) -> list[torch.Tensor]:
    """The per-layer tensors of a ``packed_kv`` cache (one tensor per layer)."""
    import torch

    out = [v for v in cache.values() if isinstance(v, torch.Tensor)]
    if len(out) != len(cache):
        raise KvplaneError("engine calls: the packed_kv cache must hold one tensor per layer")
    return out


def _pair(backend: Backend, engine: str, mib: int) -> _Pair:
    import torch

    tokens = mib * (1 << 20) // TOKEN_BYTES
    blocks = -(-tokens // BLOCK_TOKENS)
    common: dict[str, Any] = {"transport": engine, "transfer_timeout_s": WAIT_S, "lease_s": WAIT_S,
                              "heartbeat_s": 1.0, "handshake_timeout_s": 30.0}
    p_cache = allocate_cache(SPEC, "packed_kv", blocks)
    d_cache = allocate_cache(SPEC, "packed_kv", blocks)
    for i, t in enumerate(_tensors(p_cache)):  # distinct bytes per layer and block, so a misplaced one shows
        per_block = (torch.arange(blocks) * 7 + i).remainder(251).to(torch.uint8)
        t8 = t.view(torch.uint8)  # a permuted view (vLLM's logical shape): assign by broadcasting, not .view
        t8[:] = per_block.view(blocks, *([1] * (t8.dim() - 1)))
    tag = uuid.uuid4().hex[:6]
    prefill = PrefillSide(bind(backend, SPEC, p_cache, "packed_kv"), DisaggConfig(engine_id=f"calls-p-{tag}", **common))
    decode = DecodeSide(bind(backend, SPEC, d_cache, "packed_kv"), DisaggConfig(engine_id=f"calls-d-{tag}", **common))
    return _Pair(prefill, decode, p_cache, d_cache, blocks)


_held: Held[_Pair] = Held(_Pair.close)


def _release() -> None:
    _held.release()


@dataclass
class _Rep:
    inflight: list[float]  # seconds per get_finished call while the transfer was in flight
    idle: list[float]  # the same calls afterwards, nothing in flight
    cpu: list[float]  # the engine thread's CPU seconds per in-flight call
    transfer_s: float


def _calls(pair: _Pair) -> tuple[float, float, list[Any]]:
    """One engine step's calls on both sides: (wall s per call, thread CPU s per call, decode's completions)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    finished = pair.decode.get_finished()
    pair.prefill.get_finished()
    return (time.perf_counter() - w0) / 2, (time.thread_time() - c0) / 2, finished


def _one(pair: _Pair, src_ids: list[int], dst_ids: list[int]) -> _Rep:
    rid = f"calls-{uuid.uuid4().hex[:10]}"
    tokens = pair.blocks * BLOCK_TOKENS
    params = pair.prefill.request_finished(rid, {0: src_ids}, tokens)
    start = time.monotonic()
    pair.decode.start_pull(rid, params, {0: dst_ids}, tokens)
    rep = _Rep([], [], [], 0.0)
    while True:
        wall, cpu, finished = _calls(pair)
        done = [c for c in finished if c.request_id == rid]
        if done:
            rep.transfer_s = time.monotonic() - start
            if done[0].state != "done":
                raise KvplaneError(f"engine calls: the transfer ended {done[0].state}: {done[0].reason}")
            break
        rep.inflight.append(wall)
        rep.cpu.append(cpu)
        if time.monotonic() - start > WAIT_S:
            raise KvplaneError(f"engine calls: the transfer was not done within {WAIT_S} s")
        time.sleep(STEP_S)
    end = time.monotonic() + 2.0  # the prefill releases the request's blocks: the next rep starts clean
    while pair.prefill.held_requests() and time.monotonic() < end:
        pair.prefill.get_finished()
        time.sleep(STEP_S)
    for _ in range(max(len(rep.inflight), 50)):
        rep.idle.append(_calls(pair)[0])
        time.sleep(STEP_S)
    return rep


def _same_bytes(pair: _Pair, src_ids: list[int], dst_ids: list[int]) -> bool:
    import torch

    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    for a, b in zip(_tensors(pair.p_cache), _tensors(pair.d_cache)):
        if not torch.equal(a.index_select(0, s), b.index_select(0, d)):
            return False
    return True


def run_calls(backend: Backend, engine: str, quick: bool, mib: int | None = None,
              name: str | None = None) -> BenchResult:
    mib = mib or (QUICK_MIB if quick else FULL_MIB)
    pair = _held.get((backend.label, id(backend), engine, mib), lambda: _pair(backend, engine, mib))
    try:
        src_ids = np.random.default_rng(0).permutation(pair.blocks).tolist()
        dst_ids = list(range(pair.blocks))
        for t in _tensors(pair.d_cache):
            t.zero_()
        first = _one(pair, src_ids, dst_ids)  # also the handshake; not a rep
        verified = _same_bytes(pair, src_ids, dst_ids)
        reps = [_one(pair, src_ids, dst_ids) for _ in range(MIN_REPS)]
    finally:
        _release()
    samples = Samples()
    for rep in reps:
        samples.add(percentile(rep.inflight, 99) if rep.inflight else 0.0,
                    statistics.fmean(rep.cpu) if rep.cpu else 0.0, percentile(rep.idle, 99))
    inflight = [c * 1e3 for r in reps for c in r.inflight]
    idle = [c * 1e3 for r in reps for c in r.idle]
    nbytes = pair.blocks * BLOCK_TOKENS * TOKEN_BYTES
    p99 = percentile(inflight, 99)
    params: dict[str, Any] = {
        "engine": engine, "mode": "get_finished", "mib": mib, "calls": len(inflight),
        "p50_ms": round(percentile(inflight, 50), 4), "p99_ms": round(p99, 4),
        "max_ms": round(max(inflight, default=float("nan")), 4),
        "idle_p50_ms": round(percentile(idle, 50), 4), "idle_p99_ms": round(percentile(idle, 99), 4),
        "transfer_s": round(statistics.median(r.transfer_s for r in reps), 3),
        "first_transfer_s": round(first.transfer_s, 3), "goal_p99_ms": GOAL_P99_S * 1e3,
    }
    params["note"] = (f"get_finished during a {mib} MiB pull: p50 {params['p50_ms']:.3f} / p99 {p99:.3f} / max "
                      f"{params['max_ms']:.3f} ms over {len(inflight)} calls (goal p99 < 5 ms)")
    return make_result(scenario=name or f"calls-{engine}-get_finished", kind="calls", backend=backend.label,
                       transport=engine, nbytes=nbytes, samples=samples, baseline="get_finished, nothing in flight",
                       verified=verified, descriptors=0, params=params)


def scenario(engine: str, mib: int | None = None) -> Scenario:
    """``get_finished`` latency on the engine thread while ``engine`` pulls ``mib`` MiB (default: 2 GiB, 256
    MiB with ``--quick``)."""
    name = f"calls-{engine}-get_finished"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_calls(backend, engine, quick, mib, name)

    return Scenario(name, "calls", run, {"engine": engine, "mib": mib}, release=_release)


def main() -> None:
    from kvplane.backend import get_backend

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine", choices=("mooncake", "nixl"), action="append")
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    for engine in args.engine or ["mooncake", "nixl"]:
        r = run_calls(get_backend("cpu"), engine, False, args.mib)
        print(json.dumps({"engine": engine, "bytes": r.bytes, "verified": r.verified, **r.params}), flush=True)


if __name__ == "__main__":
    main()
