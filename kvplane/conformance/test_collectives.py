"""Collectives across two processes with the backend's collective: manifests all-gathered, finishes agreed.

An emulated device has no collective library (hccl, cncl need the hardware): there the same two-process check
runs over gloo and is reported as skipped, with the reason, rather than as a pass for a collective it did not use.
A real accelerator needs two devices (one per rank, as NCCL and HCCL require).
"""

from __future__ import annotations

import socket

import pytest

from kvplane.backend.base import Backend
from kvplane.conformance.ranks import WORLD, rank_main

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(backend: Backend, collective: str, device_per_rank: bool) -> dict[int, object]:
    import torch.multiprocessing as mp

    from kvplane.backend.registry import default_registry

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        added = [(ep.name, ep.value) for ep in default_registry().added()]
        procs = [ctx.Process(target=rank_main,
                             args=(r, backend.name, added, collective, port, device_per_rank, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.exitcode is None:
                p.terminate()
                p.join()
        codes = [p.exitcode for p in procs]
        assert codes == [0] * WORLD, f"rank processes exited with {codes} using {collective}"
        return dict(results)


def test_two_processes_gather_manifests_and_agree_on_finished_requests(kvplane_backend: Backend) -> None:
    import torch.distributed as dist

    wanted = kvplane_backend.collective_backend
    available = dist.is_available() and dist.is_backend_available(wanted)
    device_per_rank = kvplane_backend.is_accelerator and not kvplane_backend.emulated
    if device_per_rank:
        count = int(getattr(kvplane_backend, "device_count", lambda: 1)())
        if count < WORLD:
            pytest.skip(f"{kvplane_backend.label}: {wanted} needs one device per rank, {count} visible")
    if not available and not kvplane_backend.emulated:
        pytest.fail(f"{kvplane_backend.label}: torch.distributed has no {wanted!r} backend; install its plugin")
    collective = wanted if available else "gloo"
    results = _run_ranks(kvplane_backend, collective, device_per_rank)
    for rank in range(WORLD):
        assert results[rank] == ([0, 1], [4, 5], ["b", "c"]), f"rank {rank} got {results[rank]}"
    if collective != wanted:
        reason = (
            f"{kvplane_backend.label}: {wanted} is not available without the hardware; the same two-process "
            f"all-gather and agreement ran over gloo and agreed, so kvplane's collectives work with this backend's "
            f"memory, but {wanted} itself is untested"
        )
        pytest.skip(reason)
