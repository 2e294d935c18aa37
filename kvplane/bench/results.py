"""Bench results and the machine they ran on, in the JSON shape ``kvplane bench --json`` writes."""

from __future__ import annotations

import os
import platform
from typing import Any

import msgspec

from kvplane import __version__


class BenchResult(msgspec.Struct):
    scenario: str
    kind: str  # offload | pd | plan | store
    backend: str  # the backend's label: "npu (emulated)" when it is emulated
    transport: str  # "local" for copies inside one process
    bytes: int
    seconds: float
    gbps: float
    baseline: str  # the raw operation measured in the same run
    baseline_gbps: float
    ratio: float  # kvplane over baseline
    verified: bool  # destination bytes were compared with the source
    params: dict[str, Any] = {}  # what the scenario measured beyond the ratio; "note" is printed in the table


def make_result(
    scenario: str,
    kind: str,
    backend: str,
    transport: str,
    nbytes: int,
    seconds: float,
    baseline: str,
    baseline_seconds: float,
    verified: bool,
    params: dict[str, Any] | None = None,
) -> BenchResult:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    baseline_gbps = nbytes / baseline_seconds / 1e9 if baseline_seconds > 0 else 0.0
    return BenchResult(
        scenario=scenario,
        kind=kind,
        backend=backend,
        transport=transport,
        bytes=nbytes,
        seconds=seconds,
        gbps=round(gbps, 3),
        baseline=baseline,
        baseline_gbps=round(baseline_gbps, 3),
        ratio=round(gbps / baseline_gbps, 3) if baseline_gbps else 0.0,
        verified=verified,
        params=params or {},
    )


def machine_info(backend_label: str) -> dict[str, Any]:
    import torch

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_threads": torch.get_num_threads(),
        "kvplane": __version__,
        "backend": backend_label,
    }


def write_json(path: str, machine: dict[str, Any], results: list[BenchResult]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode({"machine": machine, "results": results}), indent=2))
