"""The GPU run's Markdown report (``gpu_run``): the machine, each part's status, and every figure beside its
baseline from the same run, with the issue's goals checked row by row.

Goals (docs/gpu.md): an offload row reaches ``OFFLOAD_GBPS`` and ``OFFLOAD_RATIO`` of the pinned contiguous
``copy_``; a NIXL P/D row reaches ``PD_OF_RAW`` of the raw agent moving kvplane's own descriptors.
"""

from __future__ import annotations

from typing import Any

OFFLOAD_GBPS, OFFLOAD_RATIO, PD_OF_RAW = 45.0, 0.9, 0.95
ROUTES = ("dma", "loop", "staged", "direct")


def _mb(row: dict[str, Any]) -> str:
    return f"{row['bytes'] / 1e6:.0f}"


def _ok(row: dict[str, Any]) -> str:
    return "yes" if row.get("verified") else "NO"


def _parts(report: dict[str, Any]) -> list[str]:
    lines = ["| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']} |" for p in report["parts"]]
    return lines


def _conformance(found: dict[str, Any] | None) -> list[str]:
    if not found:
        return ["No conformance report was written (see the part's status and run.log)."]
    outcomes: dict[str, int] = {}
    for check in found.get("checks", []):
        outcomes[check["outcome"]] = outcomes.get(check["outcome"], 0) + 1
    lines = [f"Backend `{found.get('label')}`, copy path: {found.get('copy_path')}.",
             "Checks: " + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) + ".", ""]
    failed = [c for c in found.get("checks", []) if c["outcome"] == "failed"]
    lines += [f"- FAILED `{c['check']}[{c['params']}]`: {c['detail'][:300]}" for c in failed]
    for b in found.get("bandwidth", []):
        lines.append(f"- bandwidth {b['direction']}: {b['gbps']:.2f} GB/s vs contiguous {b['baseline_gbps']:.2f} GB/s "
                     f"({b['descriptors']} descriptors, {b['nbytes'] >> 20} MiB)")
    return lines


def _offload(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"| row | cache | MB | descriptors | route | GB/s | copy_ GB/s | ratio | goal >= {OFFLOAD_GBPS:.0f} GB/s "
             f"and >= {OFFLOAD_RATIO}x | bytes equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["params"]
        met = r["gbps"] >= OFFLOAD_GBPS and r["ratio"] >= OFFLOAD_RATIO
        lines.append(f"| {r['scenario']} | {p.get('cache', 'per-layer')} | {_mb(r)} | {r['descriptors']} | "
                     f"{p.get('route', '-')} | {r['gbps']:.2f} | {r['baseline_gbps']:.2f} | {r['ratio']:.2f} | "
                     f"{'met' if met else 'missed'} | {_ok(r)} |")
    return lines


def _sweep(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| row | descriptors | auto route | auto GB/s | " + " | ".join(f"{k} GB/s (x copy_)" for k in ROUTES)
             + " | copy_ GB/s | bytes equal |", "|---" * (6 + len(ROUTES)) + "|"]
    crossover: Any = None
    for r in rows:
        p = r["params"]
        crossover = p.get("crossover") or crossover
        cells = [f"{p['gbps_by_route'][k]:.2f} ({p['ratio_by_route'][k]:.2f})" if k in p["gbps_by_route"] else "-"
                 for k in ROUTES]
        lines.append(f"| {r['scenario']} | {r['descriptors']} | {p.get('auto_route')} | {r['gbps']:.2f} | "
                     + " | ".join(cells) + f" | {r['baseline_gbps']:.2f} | {_ok(r)} |")
    if crossover:
        lines += ["", f"Crossover ({crossover.get('source')}): DMA from {crossover.get('size')} B per descriptor; the "
                  f"kernel from {crossover.get('count')} descriptors."]
    return lines


def _pd(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| row | MB | descriptors | kvplane ms | raw per-block ms | ratio | raw same descriptors ms | of raw "
             f"agent | goal >= {PD_OF_RAW} | bytes equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["params"]
        same, of_raw = p.get("raw_same_plan_ms"), p.get("of_ceiling")
        goal = "-" if of_raw is None else "met" if of_raw >= PD_OF_RAW else "missed"
        lines.append(f"| {r['scenario']} | {_mb(r)} | {r['descriptors']} | {r['seconds'] * 1e3:.1f} | "
                     f"{p.get('raw_ms', round(r['bytes'] / max(r['baseline_gbps'], 1e-9) / 1e6, 1))} | "
                     f"{r['ratio']:.2f} | {same if same is not None else '-'} | "
                     f"{of_raw if of_raw is not None else '-'} | {goal} | {_ok(r)} |")
    return lines


def _tune(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| part | row | route | GB/s | copy_ GB/s | ratio | bytes equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["params"]
        lines.append(f"| {r['part']} | {r['scenario']} | {p.get('route', p.get('auto_route', '-'))} | "
                     f"{r['gbps']:.2f} | {r['baseline_gbps']:.2f} | {r['ratio']:.2f} | {_ok(r)} |")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    tune = [r for r in report["results"] if r.get("part", "").startswith("tune-")]
    results = [r for r in report["results"] if not r.get("part", "").startswith("tune-")]
    by = {name: [r for r in results if r["scenario"].startswith(prefix)]
          for name, prefix in (("sweep", "sweep-"), ("pd", "pd-"))}
    offload = [r for r in results if r["scenario"].startswith(("copy-", "offload-"))]
    lines = [
        f"# kvplane GPU run: device `{report['device']}`" + (" (quick: the CPU twin)" if report["quick"] else ""),
        "",
        f"- nvidia-smi: {m.get('nvidia_smi', '-')}",
        f"- torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), {m.get('torch_device', 'no CUDA device')}; "
        f"Python {m.get('python')}, {m.get('cpus')} CPUs",
        "",
        "## Parts", "", *_parts(report), "",
        "## Conformance", "", *_conformance(report.get("conformance")), "",
        "## Offload: scattered blocks against a pinned contiguous copy_", "", *_offload(offload), "",
        "## Descriptor sizes by copy route (device side spread, host side packed)", "", *_sweep(by["sweep"]), "",
        "## P/D over NIXL: kvplane against the raw agent", "", *_pd(by["pd"]), "",
        "## Copy kernel variants (KVPLANE_COPY_KERNEL_CHUNK, KVPLANE_COPY_KERNEL_HINT16)", "", *_tune(tune), "",
    ]
    return "\n".join(lines)
