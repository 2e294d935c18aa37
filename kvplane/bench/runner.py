"""Runs bench scenarios with a progress bar, prints the table, writes JSON and the plot."""

from __future__ import annotations

import gc

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvplane.backend.base import Backend
from kvplane.bench.plot import plot
from kvplane.bench.results import BenchResult, machine_info, write_json
from kvplane.bench.scenarios import Scenario
from kvplane.errors import KvplaneError


def run(
    backend: Backend,
    scenarios: list[Scenario],
    *,
    quick: bool,
    json_path: str | None,
    plot_path: str | None,
    console: Console,
) -> list[BenchResult]:
    results: list[BenchResult] = []
    failures: list[str] = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("bench", total=len(scenarios))
        for scenario in scenarios:
            progress.update(task, description=scenario.name)
            try:
                results.append(scenario.run(backend, quick))
            except KvplaneError as e:  # one broken scenario must not hide the others' numbers
                failures.append(f"{scenario.name}: {e}")
            progress.advance(task)
            gc.collect()
    console.print(table(results, backend.label))
    for failure in failures:
        console.print(f"[red]failed[/red] {failure}")
    machine = machine_info(backend.label)
    if json_path:
        write_json(json_path, machine, results)
        console.print(f"results: {json_path}")
    if plot_path and plot(results, plot_path, f"kvplane bench on {backend.label} ({machine['cpus']} CPUs)"):
        console.print(f"plot: {plot_path}")
    if failures:
        raise KvplaneError(f"{len(failures)} bench scenario(s) failed")
    return results


def table(results: list[BenchResult], label: str) -> Table:
    t = Table(title=f"kvplane bench - backend {label}")
    t.add_column("scenario", no_wrap=True, min_width=28)
    for col in ("kind", "transport", "MB", "GB/s", "baseline", "baseline GB/s", "ratio", "verified", "note"):
        t.add_column(col, justify="right" if col in ("MB", "GB/s", "baseline GB/s", "ratio") else "left")
    for r in results:
        t.add_row(
            r.scenario,
            r.kind,
            r.transport,
            f"{r.bytes / 1e6:.0f}",
            f"{r.gbps:.2f}",
            r.baseline,
            f"{r.baseline_gbps:.2f}",
            f"{r.ratio:.2f}",
            "yes" if r.verified else "[red]NO[/red]",
            str(r.params.get("note", "")),
        )
    return t
