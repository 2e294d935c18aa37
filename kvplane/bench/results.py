"""Bench results and the machine they ran on, in the JSON shape ``kvplane bench --json`` writes.

``seconds`` and ``baseline_gbps`` are medians over the row's interleaved reps; ``spread`` has the min and max
of both sides, ``cpu_seconds`` kvplane's median CPU seconds per rep, ``descriptors`` the copy descriptors
kvplane handed its engine (0 where nothing is copied).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import msgspec

from kvplane import __version__
from kvplane.bench.timing import Samples


class BenchResult(msgspec.Struct):
    scenario: str
    kind: str  # offload | pd | plan | store | overhead | calls
    backend: str  # the backend's label: "npu (emulated)" when it is emulated
    transport: str  # "local" for copies inside one process
    bytes: int
    seconds: float  # median over reps
    gbps: float
    baseline: str  # the raw operation measured in the same run
    baseline_gbps: float
    ratio: float  # kvplane over baseline (speed; for timed-only rows baseline seconds over kvplane seconds)
    verified: bool  # destination bytes were compared with the source
    params: dict[str, Any] = {}  # what the scenario measured beyond the ratio; "note" is printed under the table
    descriptors: int = 0
    cpu_seconds: float = 0.0  # kvplane's CPU seconds per rep (median)
    reps: int = 0
    spread: dict[str, float] = {}  # seconds: min/median/max of kvplane and of the baseline

    @property
    def baseline_seconds(self) -> float:
        return self.spread.get("baseline_median_s", 0.0)


def make_result(
    scenario: str,
    kind: str,
    backend: str,
    transport: str,
    nbytes: int,
    samples: Samples,
    baseline: str,
    verified: bool,
    descriptors: int,
    params: dict[str, Any] | None = None,
) -> BenchResult:
    seconds, baseline_seconds = samples.median, samples.baseline_median
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    baseline_gbps = nbytes / baseline_seconds / 1e9 if baseline_seconds > 0 else 0.0
    ratio = baseline_seconds / seconds if seconds > 0 else 0.0
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
        ratio=round(ratio, 3),
        verified=verified,
        params=params or {},
        descriptors=descriptors,
        cpu_seconds=round(samples.cpu_median, 6),
        reps=samples.reps,
        spread={
            "min_s": round(min(samples.ours), 6),
            "median_s": round(seconds, 6),
            "max_s": round(max(samples.ours), 6),
            "baseline_min_s": round(min(samples.baseline), 6),
            "baseline_median_s": round(baseline_seconds, 6),
            "baseline_max_s": round(max(samples.baseline), 6),
        },
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
