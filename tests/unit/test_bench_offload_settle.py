"""The offload rows keep the baseline's leftovers out of kvplane's reps: torch's OpenMP worker spins 10-13 ms of
CPU after a parallel ``copy_`` (measured on the 2-core machine), so kvplane's next rep starts only after an
untimed pause."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.bench import offload
from kvplane.bench.timing import interleave


@pytest.mark.parametrize("direction", ["store", "load"])
def test_offload_rows_pause_untimed_after_each_baseline_copy(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    seen: dict[str, Any] = {}

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return interleave(*args, **kwargs)

    monkeypatch.setattr(offload, "TOKENS", 160)  # ten blocks: the row's path, not its size, is under test
    monkeypatch.setattr(offload, "interleave", recording)
    backend = CpuBackend(copy_threads=1)
    try:
        row = offload.run_offload(backend, "deepseek-v3", direction, quick=False)
    finally:
        offload._release()
    assert row.verified
    assert seen.get("settle_s", 0.0) >= 0.02  # the spin measured here lasts up to 13 ms
