"""Engine-call latency during a transfer: how long ``get_finished`` and ``transfers_in_flight`` take on the
engine's thread while a large P/D transfer is in flight.

A ``PrefillSide`` and a ``DecodeSide`` run in this process on 127.0.0.1 (Mooncake TE or NIXL); the decode pulls
one request of ``--mib`` MiB, and the engine thread calls ``get_finished()`` on both sides in a loop until the
request is reported, timing each call. The figures are p50/p99/max of the calls made while the transfer was in
flight. Run: ``python -m kvplane.bench.engine_calls --engine nixl --mib 1024``. Not yet a registered scenario
(the scenario list belongs to ``kvplane.bench.scenarios``).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import numpy as np

from kvplane.backend import get_backend
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import allocate_cache
from kvplane.kv.spec import KVSpec

SPEC = KVSpec.gqa(8, 8, 128, tokens_per_block=16)  # 32 KiB per token (bf16), 512 KiB per 16-token block


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def measure(engine: str, mib: int) -> dict[str, Any]:
    backend = get_backend("cpu")
    tokens = mib * (1 << 20) // (32 * 1024)
    blocks = -(-tokens // 16)
    common: dict[str, Any] = {"transport": engine, "transfer_timeout_s": 300.0, "lease_s": 300.0,
                              "heartbeat_s": 1.0, "handshake_timeout_s": 30.0}
    p_cache = allocate_cache(SPEC, "gqa_fused", blocks)
    d_cache = allocate_cache(SPEC, "gqa_fused", blocks)
    tag = uuid.uuid4().hex[:6]
    prefill = PrefillSide(backend, SPEC, p_cache, DisaggConfig(engine_id=f"calls-p-{tag}", **common),
                          layouts="gqa_fused")
    decode = DecodeSide(backend, SPEC, d_cache, DisaggConfig(engine_id=f"calls-d-{tag}", **common),
                        layouts="gqa_fused")
    try:
        ids = np.random.default_rng(0).permutation(blocks).tolist()
        params = prefill.request_finished("big", {0: ids}, tokens)
        start = time.monotonic()
        decode.start_pull("big", params, {0: list(range(blocks))})
        calls: list[float] = []
        done = False
        while not done:
            t0 = time.perf_counter()
            finished = decode.get_finished(timeout_s=300.0)
            prefill.get_finished(timeout_s=300.0)
            calls.append((time.perf_counter() - t0) / 2)
            done = any(c.request_id == "big" for c in finished)
            if done and finished[0].state != "done":
                raise RuntimeError(f"the transfer ended {finished[0].state}: {finished[0].reason}")
            time.sleep(0.001)  # an engine step's worth of other work
        total = time.monotonic() - start
    finally:
        decode.close()
        prefill.close()
    ms = [c * 1000 for c in calls]
    return {"engine": engine, "bytes": tokens * 32 * 1024, "transfer_s": round(total, 3), "calls": len(ms),
            "p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
            "max_ms": round(max(ms), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("mooncake", "nixl"), action="append")
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    for engine in args.engine or ["mooncake", "nixl"]:
        print(json.dumps(measure(engine, args.mib)), flush=True)


if __name__ == "__main__":
    main()
