"""Store put/get GB/s through kvplane's tier under vLLM's own TieringOffloadingManager, against raw store calls.

In one run, against one real ``mooncake_master``: ``raw`` puts N objects of one primary slot each with kvplane's
``StoreTier.put`` from registered host memory and gets them back with ``StoreTier.get``, waiting for each call;
``tier`` stores the same number of slots through vLLM's manager (timed from ``complete_store``: the cascade to
``KVPlaneStoreTier``, an existence check and the put, polled until the job is reported) on instance A, and loads them on instance B (``lookup``
until the promotion from the store has landed). Fresh keys each repetition. Prints per repetition and the medians,
the tier/raw ratio, and the process CPU time of each. Usage (from the checkout, .venv or .venv-vllm2):

    .venv/bin/python scripts/bench-native-tier.py [--slots 64] [--head-dim 1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("vllm", "unit")]

import numpy as np  # noqa: E402
from realsched import tiny_model_dir  # noqa: E402
from tiering_rig import TieredInstance, block_keys, tier_entry  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from kvplane.flows.offload import start_master  # noqa: E402
from kvplane.flows.offload.config import StoreConfig  # noqa: E402
from kvplane.flows.offload.store import StoreTier  # noqa: E402


def timed(fn):  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ("raw put", "tier put", "raw get", "tier get")}
    with start_master() as master, tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_dir(Path(tmp))
        store = {"segment_bytes": 1 << 30, "local_buffer_bytes": 64 << 20, "timeout_s": 30.0}
        kw = {"cpu_blocks": a.slots + 8, "head_dim": a.head_dim, "pause_s": 0.0002}
        one = TieredInstance(model, tier_entry(master.address, **store), **kw)
        two = TieredInstance(model, tier_entry(master.address, **store), **kw)
        slot = one.view.shape[1]
        raw = StoreTier(StoreConfig(master.address, segment_bytes=1 << 30, local_buffer_bytes=64 << 20,
                                    timeout_s=30.0, namespace="bench-raw"))
        src = np.random.default_rng(0).integers(0, 255, a.slots * slot, dtype=np.uint8)
        dst = np.zeros_like(src)
        raw.register(src.ctypes.data, src.nbytes)
        raw.register(dst.ctypes.data, dst.nbytes)
        addrs = [src.ctypes.data + i * slot for i in range(a.slots)]
        back = [dst.ctypes.data + i * slot for i in range(a.slots)]
        try:
            for rep in range(a.reps):
                names = [f"raw/{rep}/{i}" for i in range(a.slots)]
                rows["raw put"].append(timed(lambda: raw.put(names, addrs, [slot] * a.slots).result()))
                rows["raw get"].append(timed(lambda: raw.get(names, back, [slot] * a.slots)))
                assert (dst == src).all()
                keys = block_keys(list(range(rep * 100_000, rep * 100_000 + 16 * a.slots)))
                staged = one.stage(keys)  # the GPU -> CPU copy (played by writing the slots): not timed
                rows["tier put"].append(timed(lambda: one.cascade(*staged)))
                got: list = []
                rows["tier get"].append(timed(lambda: got.append(two.load(keys))))
                assert got[0][0] == [LookupResult.HIT] * a.slots
        finally:
            raw.close()
            one.shutdown()
            two.shutdown()
    nbytes = a.slots * slot
    print(f"{a.slots} objects of {slot} B ({nbytes / 2**20:.1f} MiB) per call, {a.reps} repetitions, loopback TCP")
    med = {k: statistics.median(w for w, _ in v) for k, v in rows.items()}
    for k, v in rows.items():
        walls = " ".join(f"{nbytes / w / 1e9:.2f}" for w, _ in v)
        cpu = statistics.median(c for _, c in v)
        print(f"{k:9s} GB/s per rep: {walls}  median {nbytes / med[k] / 1e9:.2f} GB/s, CPU {cpu * 1e3:.0f} ms")
    for op in ("put", "get"):
        print(f"tier/raw {op}: {med[f'raw {op}'] / med[f'tier {op}']:.2f} (throughput ratio)")


if __name__ == "__main__":
    main()
