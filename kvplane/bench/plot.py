"""The bench plot: one figure, one panel per kind, and a ratio panel beside them.

Offload, P/D and store panels draw GB/s per row as grouped bars, kvplane solid and its baseline hatched beside
it, labelled by model, transport and mode, with kvplane's descriptor count over its bar. Timed-only rows (plan,
overhead) are drawn in milliseconds. Block-size sweeps (``copy-*`` rows, ``--full``) are lines against tokens
per block. The ratio panel has every row's kvplane/baseline ratio with the 1.0 line marked. Colours belong to
transports and never change between runs; the legend sits above the panels, outside the data.
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict
from typing import Any

from kvplane.bench.results import BenchResult
from kvplane.bench.table import label

PLOT_HINT = "pip install 'kvplane[bench]' (or matplotlib), then run kvplane bench again"
COLOURS = {
    "local": "#4C72B0",
    "mooncake": "#DD8452",
    "nixl": "#55A868",
    "mooncake-store": "#C44E52",
    "none": "#8172B3",
}
OTHER = "#7F7F7F"
BAR_KINDS = ("offload", "pd", "store")
TIMED_KINDS = ("overhead", "plan", "calls")
TITLES = {
    "offload": "offload: host tier store/load (GB/s)",
    "pd": "P/D: prefill done -> KV ready, or transport only (GB/s)",
    "store": "Mooncake Store tier (GB/s)",
    "timed": "kvplane's own time (ms): offload with copies stubbed (hatched: the copy it manages),\n"
             "plans (hatched: bare numpy arithmetic), get_finished p99 during a transfer (hatched: idle)",
    "sweep": "block copy plans by block size (GB/s)",
    "serve": "live vLLM servers: TTFT (ms), P/D (hatched: one plain instance), host-tier hit (hatched: miss)",
}


def plot_available() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a finder that refuses it (or a broken install): no plot, the hint says why
        return False


def _colour(r: BenchResult) -> str:
    return COLOURS.get(r.transport, OTHER)


def _desc(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _bars(ax: Any, rows: list[BenchResult], *, timed: bool, kinds: bool = False) -> None:
    width = 0.38
    xs = range(len(rows))
    for x, r in zip(xs, rows):
        c = _colour(r)
        ours = r.seconds * 1e3 if timed else r.gbps
        base = r.baseline_seconds * 1e3 if timed else r.baseline_gbps
        ax.bar(x - width / 2, ours, width, color=c, edgecolor=c)
        ax.bar(x + width / 2, base, width, color=c, alpha=0.35, hatch="///", edgecolor=c)
        if r.descriptors:
            ax.annotate(_desc(r.descriptors), (x - width / 2, ours), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(list(xs))
    names = [(f"{r.kind} " if kinds else "") + label(r) for r in rows]
    ax.set_xticklabels([n.replace(" ", "\n") for n in names], fontsize=7.5)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.margins(y=0.25)
    if timed:
        ax.set_yscale("log")
    ax.set_ylabel("ms (log)" if timed else "GB/s")
    ax.grid(True, axis="y", alpha=0.3)


def _sweep(ax: Any, rows: list[BenchResult]) -> None:
    series: dict[str, list[BenchResult]] = defaultdict(list)
    for r in rows:
        series[f"{label(r).rsplit(' ', 1)[0]}"].append(r)
    markers = "osD^v<>"
    for i, (name, rs) in enumerate(sorted(series.items())):
        rs.sort(key=lambda r: r.params["block_tokens"])
        xs = [r.params["block_tokens"] for r in rs]
        ax.plot(xs, [r.gbps for r in rs], marker=markers[i % len(markers)], color=f"C{i}", label=name)
        ax.plot(xs, [r.baseline_gbps for r in rs], ls="--", color=f"C{i}", alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per block (dashed: contiguous copy_ baseline)")
    ax.set_ylabel("GB/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.5)


def _ratios(ax: Any, rows: list[BenchResult]) -> None:
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        ax.barh(y, r.ratio - 1.0, left=1.0, color=_colour(r), height=0.7)  # from the 1.0 line either way
        right = r.ratio >= 1.0
        ax.annotate(f"{r.ratio:.2f}", (r.ratio, y), xytext=(3 if right else -3, 0), textcoords="offset points",
                    va="center", ha="left" if right else "right", fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=1.2, ls="--")
    ax.text(0.5, 1.0, "dashed line: as fast as the baseline", transform=ax.transAxes, fontsize=7, ha="center",
            va="bottom")
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{r.kind} {label(r)}" for r in rows], fontsize=7.5)
    ax.set_ylim(-0.7, len(rows) + 0.4)
    low = min(0.5, min(r.ratio for r in rows) / 3)
    high = max(2.0, max(r.ratio for r in rows) * 3)
    ax.set_xlim(low, high)
    ax.set_xlabel("kvplane speed / baseline speed (log)")
    ax.set_title("ratio (higher is better)\n", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3, which="major")


def plot(results: list[BenchResult], path: str, title: str) -> bool:
    """Write the PNG; False (nothing written) when there are no results."""
    if not results:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sweep = [r for r in results if r.scenario.startswith("copy-") and "block_tokens" in r.params]
    panels: list[tuple[str, list[BenchResult]]] = []
    for kind in BAR_KINDS:
        rows = [r for r in results if r.kind == kind and r not in sweep]
        if rows:
            panels.append((kind, rows))
    timed = [r for r in results if r.kind in TIMED_KINDS]
    if timed:
        panels.append(("timed", timed))
    serve = [r for r in results if r.kind == "serve"]
    if serve:
        panels.append(("serve", serve))
    if sweep:
        panels.append(("sweep", sweep))
    widest = max(len(rows) for _, rows in panels)
    # overhead and engine-call latency are no speed ratios
    ratio_rows = [r for r in results if r.ratio > 0 and r.kind not in ("overhead", "calls")]
    height = max(2.6 * len(panels), 0.24 * len(ratio_rows)) + 1.0
    fig = plt.figure(figsize=(max(13.0, 5.0 + 0.95 * widest), height))
    top = 1.0 - 1.25 / height
    grid = fig.add_gridspec(len(panels), 2, width_ratios=[3.0, 1.0], hspace=0.8, wspace=0.32, top=top,
                            bottom=0.6 / height)
    for i, (kind, rows) in enumerate(panels):
        ax = fig.add_subplot(grid[i, 0])
        if kind == "sweep":
            _sweep(ax, rows)
        else:
            _bars(ax, rows, timed=kind in ("timed", "serve"), kinds=kind == "timed")
        ax.set_title(TITLES.get(kind, kind), fontsize=10, loc="left")
    if ratio_rows:
        _ratios(fig.add_subplot(grid[:, 1]), ratio_rows)
    used = sorted({r.transport for r in results}, key=lambda t: list(COLOURS).index(t) if t in COLOURS else 99)
    handles = [Patch(color=COLOURS.get(t, OTHER), label=t) for t in used]
    handles += [Patch(facecolor="grey", label="kvplane"),
                Patch(facecolor="grey", alpha=0.35, hatch="///", label="baseline"),
                Patch(color="white", label="numbers over bars: kvplane's descriptors")]
    fig.suptitle(title, fontsize=12, y=1.0 - 0.1 / height, va="top")
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 1.0 - 0.38 / height))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
