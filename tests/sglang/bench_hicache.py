"""Put and get GB/s through the SGLang backend against raw ``StoreTier.put``/``get`` of the same bytes, one run.

Usage: ``.venv-sglang/bin/python tests/sglang/bench_hicache.py [--pages 64] [--rounds 5]``. It starts a loopback
``mooncake_master``, builds SGLang's own MHA host pool (page_first: 2 objects a page) on CPU, and times, round
after round with fresh keys, ``batch_set_v1``/``batch_get_v1`` of a batch of pages and then the same page ranges
(from ``get_page_buffer_meta``) through the backend's own ``StoreTier`` directly. Prints the median GB/s of each.
A measurement, not a test: loopback TCP on this machine, not a network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchvision_stand_in import install_if_missing  # noqa: E402

install_if_missing()

from hicache_pools import MiB, extra_config, fill, mha_host, page_hashes, slots, storage_config  # noqa: E402

from kvplane.flows.offload import start_master  # noqa: E402
from kvplane.integrations.sglang.backend import KvplaneHiCacheStorage  # noqa: E402


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64, help="pages of 2 MiB per batch (SGLang batches up to 128)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    geometry = {"layers": 8, "heads": 8, "head_dim": 128, "page": 64, "tokens": 2 * args.pages * 64}
    master = start_master()
    pool = mha_host("page_first", **geometry)
    fill(pool, seed=1)
    batch = args.pages * 2 * MiB  # every round's pages stay stored, twice (backend and raw): the segment holds them
    segment = (args.rounds * 2 * batch * 5 // 4 + MiB - 1) // MiB * MiB
    extra = extra_config(master.address, namespace="bench", segment_bytes=segment, local_buffer_bytes=64 * MiB,
                         timeout_s=30.0)
    backend = KvplaneHiCacheStorage(storage_config(extra), {})
    backend.register_mem_pool_host(pool)
    tier = backend.pages.tier
    src, dst = slots(pool, list(range(args.pages))), slots(pool, list(range(args.pages, 2 * args.pages)))
    ptrs, sizes = pool.get_page_buffer_meta(src)
    dptrs, _ = pool.get_page_buffer_meta(dst)
    nbytes = sum(sizes)
    times: dict[str, list[float]] = {"backend put": [], "backend get": [], "tier put": [], "tier get": []}
    try:
        for r in range(args.rounds):
            keys = page_hashes(args.pages, seed=1000 + r, page=64)
            t = time.perf_counter()
            assert all(backend.batch_set_v1(keys, src))
            times["backend put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            assert all(backend.batch_get_v1(keys, dst))
            times["backend get"].append(time.perf_counter() - t)
            raw = [f"raw/{r}/{i}" for i in range(len(ptrs))]
            t = time.perf_counter()
            put = tier.put(raw, ptrs, sizes)
            assert put is not None and all(rc == 0 for rc in put.result(60))
            times["tier put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ok, _ = tier.get(raw, dptrs, sizes)
            assert all(ok)
            times["tier get"].append(time.perf_counter() - t)
        print(f"{args.pages} pages x {nbytes // args.pages} B = {nbytes / MiB:.0f} MiB a batch, {args.rounds} rounds, "
              f"median:")
        for what, seconds in times.items():
            print(f"  {what:12s} {gbps(nbytes, seconds):6.2f} GB/s  ({statistics.median(seconds) * 1e3:.1f} ms)")
    finally:
        backend.close()
        master.stop()


if __name__ == "__main__":
    main()
