"""Run by test_triton_copy_kernel.py in a child with ``TRITON_INTERPRET=1``: the cuda backend's Triton copy kernel
on CPU memory, alone (every word size, random descriptors) and as the copy kernel of an emulated accelerator (the
staged and direct routes over random blocks of real KV layouts). Prints one line per check; exits 1 on a mismatch."""

from __future__ import annotations

import sys

import numpy as np
import torch
from kvplane_ascend.backend import AscendBackend
from kvplane_cuda.gather import TritonCopyKernel

from kvplane.conformance.helpers import fill_random, mismatches
from kvplane.descriptors import CopyPlan
from kvplane.kv.binding import allocate_cache, regions_from_tensors
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan
from kvplane.testing.backends import emulated_backend

KERNEL = TritonCopyKernel(torch.device("cpu"))
failures = 0


def check(name: str, ok: bool) -> None:
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)


def descriptors_alone(seed: int, align: int) -> None:
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8))
    dst, want = torch.zeros_like(src), torch.zeros_like(src)
    n = 12
    starts = rng.choice((1 << 16) // 4096, n, replace=False) * 4096 + align
    targets = rng.choice((1 << 16) // 4096, n, replace=False) * 4096 + align
    lengths = rng.integers(1, 4096 // max(align, 1) - 1, n) * max(align, 1)
    for s, d, k in zip(starts, targets, lengths):
        want[d:d + k] = src[s:s + k]
    KERNEL.launch(CopyPlan(src.data_ptr() + starts.astype(np.int64), dst.data_ptr() + targets.astype(np.int64),
                           lengths.astype(np.int64)), None)
    check(f"descriptors alone, addresses and lengths multiples of {align}", torch.equal(dst, want))


class TritonAscend(emulated_backend(AscendBackend)):  # type: ignore[misc]
    name = "npu-emulated-triton"

    def copy_kernel(self) -> TritonCopyKernel:
        return KERNEL


def routes(family: str, route: str, direction: str) -> None:
    backend = TritonAscend(0)
    spec = KVSpec.mla(2, tokens_per_block=16) if family == "mla" else KVSpec.gqa(2, 2, 64, tokens_per_block=16)
    layout = backend.layouts[family]
    device = allocate_cache(spec, layout, 24, alloc=backend.alloc_device)
    host = allocate_cache(spec, layout, 24, alloc=backend.alloc_host)
    src, dst = (device, host) if direction == "d2h" else (host, device)
    fill_random(backend, spec, src, layout, seed=len(route))
    rng = np.random.default_rng(len(route) + len(direction))
    src_ids, dst_ids = rng.choice(24, 7, replace=False), rng.choice(24, 7, replace=False)
    plan = block_copy_plan(regions_from_tensors(spec, src, layout), src_ids.astype(np.int64),
                           regions_from_tensors(spec, dst, layout), dst_ids.astype(np.int64))
    backend.execute_route(plan, backend.new_stream(), direction=direction, route=route)
    check(f"{family} {direction} {route}", mismatches(spec, layout, src, src_ids, dst, dst_ids) == [])


if __name__ == "__main__":
    for seed, align in enumerate((8, 4, 2, 1)):
        descriptors_alone(seed, align)
    for family in ("gqa", "mla"):
        for route in ("staged", "direct"):
            for direction in ("d2h", "h2d"):
                routes(family, route, direction)
    sys.exit(1 if failures else 0)
