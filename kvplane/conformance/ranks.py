"""The rank processes of the collectives check (spawned; a module of its own so spawn can import it by name).

Each rank selects the backend under test as any kvplane process does (the registry, plus the plugins the
parent's registry had added, such as emulated backends), joins a two-rank group, all-gathers its manifest and
agrees on finished requests.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

WORLD = 2


def rank_main(
    rank: int, backend_name: str, added: list[tuple[str, str]], collective: str, port: int, device_per_rank: bool,
    results: MutableMapping[int, Any],
) -> None:
    from importlib.metadata import EntryPoint

    import torch.distributed as dist

    from kvplane.backend.registry import default_registry
    from kvplane.collectives import agree_finished, all_gather_manifests, init_process_group
    from kvplane.kv.binding import allocate_cache, regions_from_tensors
    from kvplane.kv.manifest import Manifest
    from kvplane.kv.spec import KVSpec

    registry = default_registry()
    for name, value in added:
        registry.add(EntryPoint(name, value, registry.group))
    backend = registry.create(backend_name, device_index=rank if device_per_rank else 0)
    set_current_device = getattr(backend, "set_current_device", None)
    if device_per_rank and callable(set_current_device):
        set_current_device()  # NCCL/HCCL/CNCL bind a rank to the calling thread's current device
    init = f"tcp://127.0.0.1:{port}"
    if collective == backend.collective_backend:
        init_process_group(backend, rank, WORLD, init)
    else:  # the device's own collective is absent here (an emulated device): the same calls over `collective`
        import datetime

        dist.init_process_group(collective, init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
    try:
        layout = backend.layouts["gqa"]
        spec = KVSpec.gqa(2, 2, 64)
        cache = allocate_cache(spec, layout, 4 + rank, alloc=backend.alloc_device)
        manifest = Manifest("conformance", rank, WORLD, backend.torch_device_type, spec, {"gqa": layout},
                            tuple(regions_from_tensors(spec, cache, layout)))
        gathered = all_gather_manifests(manifest, backend)
        agreed = agree_finished({0: ["a", "b", "c"], 1: ["b", "c", "d"]}[rank], backend)
        results[rank] = ([m.rank for m in gathered], [m.regions[0].num_blocks for m in gathered], sorted(agreed))
    finally:
        dist.destroy_process_group()
