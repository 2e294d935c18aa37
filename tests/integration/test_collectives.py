"""Collectives across two real processes with gloo: manifests gathered in rank order, finished requests agreed."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, results: dict) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    from kvplane.backend import get_backend
    from kvplane.collectives import agree_finished, all_gather_manifests, init_process_group
    from kvplane.kv.binding import allocate_cache, regions_from_tensors
    from kvplane.kv.manifest import Manifest
    from kvplane.kv.spec import KVSpec

    backend = get_backend("cpu")
    init_process_group(backend, rank, WORLD, f"tcp://127.0.0.1:{port}")
    spec = KVSpec.gqa(2, 4, 8, dtype="float32")
    cache = allocate_cache(spec, "split_kv", 4 + rank)  # ranks differ in cache size
    manifest = Manifest("prefill", rank, WORLD, "cpu", spec, {"gqa": "split_kv"},
                        tuple(regions_from_tensors(spec, cache, "split_kv")))
    gathered = all_gather_manifests(manifest, backend)
    finished = {0: ["a", "b", "c"], 1: ["b", "c", "d"]}[rank]
    agreed = agree_finished(finished, backend)
    results[rank] = ([m.rank for m in gathered], [m.regions[0].num_blocks for m in gathered], sorted(agreed))
    dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_gather_manifests_and_agree_on_finished_requests() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
        for rank in range(WORLD):
            ranks, blocks, agreed = results[rank]
            assert ranks == [0, 1]
            assert blocks == [4, 5]
            assert agreed == ["b", "c"]
