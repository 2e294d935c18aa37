"""The bench keeps freed memory in its process while rows run, so a row reuses pages an earlier row touched."""

from __future__ import annotations

import io
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_bench_report import RESULTS

from kvplane.backend import get_backend
from kvplane.bench import runner
from kvplane.bench.memory import freed_memory_kept
from kvplane.bench.results import BenchResult
from kvplane.bench.scenario import Scenario

MIB = 1 << 20


def _faults_of_touching(nbytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(nbytes, dtype=torch.uint8)  # as the bench allocates (numpy would ask for huge pages)
    buf.fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del buf
    return faults


def test_memory_a_row_freed_inside_the_block_serves_the_next_rows_smaller_buffer_without_faulting_again() -> None:
    pages = 32 * MIB // resource.getpagesize()
    with freed_memory_kept() as kept:
        if not kept:
            pytest.skip("the C library is not glibc: there is no mallopt to keep freed memory with")
        _faults_of_touching(64 * MIB)
        again = _faults_of_touching(32 * MIB)
    assert again < pages // 4, f"{again} page faults touching a 32 MiB buffer in freed memory ({pages} pages)"


OUTSIDE = """
import resource, torch
from kvplane.bench.memory import freed_memory_kept

def touch(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(1)
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

with freed_memory_kept():
    pass
touch(64 << 20)
print(touch(32 << 20))
"""


def test_outside_the_block_freed_memory_goes_back_to_the_kernel_as_glibc_does_by_default() -> None:
    """In a fresh process: glibc's mmap threshold moves with what a process freed before (its dynamic threshold),
    so after a long test session a 32 MiB buffer may come from the heap whatever the bench did."""
    pages = 32 * MIB // resource.getpagesize()
    out = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True, check=True, timeout=120)
    again = int(out.stdout.split()[-1])
    assert again > pages // 2, f"only {again} page faults touching a fresh 32 MiB buffer ({pages} pages)"


def test_the_runner_keeps_freed_memory_for_in_process_rows_only_and_gives_it_back_before_engine_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    @contextmanager
    def recording() -> Iterator[bool]:
        events.append("keep")
        yield True
        events.append("give back")

    def row(name: str, kind: str) -> Scenario:
        def run(backend: object, quick: bool) -> BenchResult:
            events.append(name)
            return RESULTS[0]

        return Scenario(name, kind, run)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "freed_memory_kept", recording)
    rows = [row("offload", "offload"), row("overhead", "overhead"), row("pd", "pd"), row("store", "store")]
    runner.run(get_backend("cpu"), rows, quick=True, json_path=None, plot_path=None,
               log_path=str(tmp_path / "b.log"), terminal=io.StringIO())
    assert events == ["keep", "offload", "overhead", "give back", "pd", "keep", "store", "give back"]
