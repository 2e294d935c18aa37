"""Runs bench scenarios, prints the table, writes JSON and the plot.

While scenarios run, file descriptors 1 and 2 point at the log file (engine logs from C, threads and peer
processes land there); the terminal gets a one-line progress indicator (only on a tty), then the table and the
paths of what was written.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from typing import TextIO

from kvplane.backend.base import Backend
from kvplane.bench.logs import engine_output_to
from kvplane.bench.memory import freed_memory_kept
from kvplane.bench.plot import PLOT_HINT, plot_available
from kvplane.bench.results import BenchResult, machine_info, write_json
from kvplane.bench.scenario import Scenario
from kvplane.bench.table import render
from kvplane.errors import KvplaneError

REUSE_MEMORY_KINDS = ("offload", "overhead", "store")  # rows whose gigabytes of buffers live in this process


def run(
    backend: Backend,
    scenarios: list[Scenario],
    *,
    quick: bool,
    json_path: str | None,
    plot_path: str | None,
    log_path: str,
    terminal: TextIO,
) -> list[BenchResult]:
    start = time.monotonic()
    results, failures = _run_all(backend, scenarios, quick, log_path)
    elapsed = time.monotonic() - start
    machine = machine_info(backend.label)
    title = (f"kvplane bench - backend {backend.label}, {machine['cpus']} CPUs, {len(results)} rows in "
             f"{elapsed:.0f} s" + (" (quick)" if quick else ""))
    print(render(results, title), file=terminal)
    for failure in failures:
        print(f"FAILED {failure}", file=terminal)
    print("", file=terminal)
    if json_path:
        write_json(json_path, machine, results)
        print(f"results: {json_path}", file=terminal)
    if plot_path:
        if not plot_available():
            print(f"plot: not drawn, matplotlib is missing ({PLOT_HINT})", file=terminal)
        else:
            from kvplane.bench.plot import plot

            if plot(results, plot_path, title):
                print(f"plot: {plot_path}", file=terminal)
    print(f"engine logs: {log_path}", file=terminal)
    terminal.flush()
    if failures:
        raise KvplaneError(f"{len(failures)} bench scenario(s) failed; tracebacks are in {log_path}")
    return results


def _run_all(backend: Backend, scenarios: list[Scenario], quick: bool, log_path: str
             ) -> tuple[list[BenchResult], list[str]]:
    """Every scenario, its output in the log: (the rows, the scenarios that raised, with their error)."""
    results: list[BenchResult] = []
    failures: list[str] = []
    start = time.monotonic()
    kept_now = False
    held: Callable[[], None] | None = None  # the release of the module whose buffers are held now
    with engine_output_to(log_path) as out, ExitStack() as kept:
        live = out.isatty()
        for i, scenario in enumerate(scenarios):
            if held is not None and held is not scenario.release:
                held()
            held = scenario.release
            # in-process rows reuse the pages earlier ones faulted in (kvplane.bench.memory); the rest (engines,
            # their threads and buffers) run with glibc's defaults, as an engine would
            if scenario.kind in REUSE_MEMORY_KINDS and not kept_now:
                kept.enter_context(freed_memory_kept())
                kept_now = True
            elif scenario.kind not in REUSE_MEMORY_KINDS and kept_now:
                kept.close()
                kept_now = False
            if live:
                out.write(f"\r\033[K[{i + 1}/{len(scenarios)}] {scenario.name}")
            # into the log, so engine lines have their scenario and each scenario its start time
            print(f"== {scenario.name} at {time.monotonic() - start:.1f} s", flush=True)
            try:
                results.append(scenario.run(backend, quick))
            except Exception as e:  # one broken scenario must not hide the others' numbers
                failures.append(f"{scenario.name}: {type(e).__name__}: {e}")
                traceback.print_exc()
            gc.collect()
        if held is not None:
            held()
        if live:
            out.write("\r\033[K")
        out.flush()
    return results, failures
