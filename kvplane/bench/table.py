"""The bench table: plain text under 100 columns, one section per kind, long notes under the table.

Times are milliseconds (median and fastest rep of each side); GB/s are medians; ``ratio`` is kvplane's speed
over the baseline's (baseline time / kvplane time); ``desc`` is the copy descriptors kvplane handed its
engine; ``cpu ms`` is kvplane's CPU time per rep (process, or thread for plan rows).
"""

from __future__ import annotations

import textwrap

from kvplane.bench.results import BenchResult

WIDTH = 100
KINDS = ("offload", "overhead", "pd", "store", "plan", "calls", "serve")
TITLES = {
    "offload": "offload: one request through OffloadEngine; baseline contiguous copy_ of the same bytes",
    "overhead": "overhead: the same requests with copies stubbed out (kvplane's own work; goal < 1 ms CPU)",
    "pd": "pd: prefill done -> KV ready (pull/push/layerwise), or transport only (read/write); vs raw engine",
    "store": "store: Mooncake Store tier put/get; baseline raw batch_put_from / batch_get_into",
    "plan": "plan: plan_transfer in ms; baseline bare numpy descriptor arithmetic",
    "calls": "calls: get_finished p99 per rep while a transfer is in flight; baseline the same call idle",
    "serve": "serve: TTFT in live vLLM servers; P/D vs one plain instance, host-tier hit vs miss",
}
SHORT = {"qwen3-0.6b": "qwen3", "deepseek-v3": "dsv3"}
ROW = 29
HEADER = (f"{'row':<{ROW}} {'MB':>5} {'ms med':>6} {'min':>6} {'base':>6} {'min':>6} "
          f"{'GB/s':>5} {'base':>5} {'ratio':>5} {'desc':>6} {'cpu ms':>6} {'ok':>3}")


def label(r: BenchResult) -> str:
    """A short row name: model, transport, mode and pattern, as far as they apply."""
    p = r.params
    parts = [SHORT.get(str(p.get("model", "")), str(p.get("model", "")))]
    if r.kind in ("pd", "calls", "serve"):
        parts.append(r.transport)  # the flow's rows say pull/push/layerwise, the transport's alone read/write
    for key in ("direction", "mode", "op"):
        if key in p:
            parts.append(str(p[key]).lower())
            break
    if "block_tokens" in p and r.scenario.startswith("copy-"):
        parts.append(f"bs{p['block_tokens']}")
    if p.get("blocks_pattern") == "runs":
        parts.append("runs")
    if p.get("cache") == "cross-layer":
        parts.append("xl")  # vLLM's one tensor for all layers
    if "same_vendor" in p:
        parts.append("x-vendor")  # Ascend's caches into CUDA's (pd_vendors)
    if r.kind == "plan":
        parts.append(f"{int(p.get('tokens', 0)) // 1000}k")
    text = " ".join(x for x in parts if x)
    return text if len(text) <= ROW else text[: ROW - 1] + "~"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _row(r: BenchResult) -> str:
    sp = r.spread
    timed_only = r.kind in ("plan", "overhead", "calls", "serve")
    gbps = "-" if timed_only else f"{r.gbps:.2f}"
    base_gbps = "-" if timed_only else f"{r.baseline_gbps:.2f}"
    ok = "n/a" if r.kind == "overhead" else "yes" if r.verified else "NO"
    return (f"{label(r):<{ROW}} {r.bytes / 1e6:>5.0f} {_ms(sp.get('median_s', r.seconds)):>6} "
            f"{_ms(sp.get('min_s', r.seconds)):>6} {_ms(sp.get('baseline_median_s', 0.0)):>6} "
            f"{_ms(sp.get('baseline_min_s', 0.0)):>6} {gbps:>5} {base_gbps:>5} {_ratio(r.ratio):>5} "
            f"{r.descriptors:>6} {r.cpu_seconds * 1e3:>6.1f} {ok:>3}")


def render(results: list[BenchResult], title: str) -> str:
    lines = [title, HEADER, "-" * len(HEADER)]
    notes: list[str] = []
    kinds = [k for k in KINDS if any(r.kind == k for r in results)]
    kinds += sorted({r.kind for r in results} - set(kinds))
    for kind in kinds:
        lines.append(TITLES.get(kind, kind))
        for r in (r for r in results if r.kind == kind):
            lines.append(_row(r))
            note = str(r.params.get("note", ""))
            if note:
                notes.append(f"{kind} {label(r)}: {note}")
    if notes:
        lines.append("")
        lines.append("notes:")
        for n in notes:
            lines.extend(textwrap.wrap(n, WIDTH, initial_indent="  ", subsequent_indent="    "))
    return "\n".join(lines)
