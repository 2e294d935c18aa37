"""Collectives across the TP ranks of one instance, through ``torch.distributed`` with the backend's collective.

``all_gather_manifests`` gives every rank every rank's manifest (so one rank can answer a peer's handshake for
the whole instance); ``agree_finished`` returns the requests that every rank has finished, so blocks are freed
only once no rank still moves them. Payloads are msgpack bytes in uint8 tensors: nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from kvplane.backend.base import Backend
from kvplane.errors import BackendError
from kvplane.kv.manifest import Manifest

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def init_process_group(
    backend: Backend, rank: int, world_size: int, init_method: str, timeout_s: float = 60.0
) -> dist.ProcessGroup:
    """Join (or create) the default process group with ``backend.collective_backend``."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        raise BackendError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        dist.init_process_group(
            backend.collective_backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    group = dist.group.WORLD
    if group is None:
        raise BackendError("torch.distributed has no default group after init_process_group")
    return group


def _device_for(backend: Backend) -> torch.device:
    import torch

    return torch.device("cpu") if backend.collective_backend == "gloo" else backend.device()


def all_gather_bytes(payload: bytes, backend: Backend, group: Any = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order."""
    import torch
    import torch.distributed as dist

    device = _device_for(backend)
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(int(s.item()) for s in sizes))
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t[: int(s.item())].cpu().numpy().tobytes()) for t, s in zip(gathered, sizes)]


def all_gather_manifests(manifest: Manifest, backend: Backend, group: Any = None) -> list[Manifest]:
    """Every TP rank's manifest, in rank order; each is decoded and checked like a peer's."""
    return [Manifest.decode(b) for b in all_gather_bytes(manifest.encode(), backend, group)]


def agree_finished(request_ids: Iterable[str], backend: Backend, group: Any = None) -> set[str]:
    """The requests every rank reports finished (the intersection); safe to free on all ranks."""
    mine = sorted(set(request_ids))
    sets = [
        set(msgspec.msgpack.decode(b, type=list[str]))
        for b in all_gather_bytes(msgspec.msgpack.encode(mine), backend, group)
    ]
    return set.intersection(*sets) if sets else set()
