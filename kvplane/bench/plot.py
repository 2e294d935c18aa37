"""The bench plot: GB/s against block size per scenario family, each with its baseline drawn beside it."""

from __future__ import annotations

import os
from collections import defaultdict

from kvplane.bench.results import BenchResult


def plot(results: list[BenchResult], path: str, title: str) -> bool:
    """Write a PNG; False (nothing written) when no result has a block size to plot against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[BenchResult]] = defaultdict(list)
    for r in results:
        if "block_tokens" in r.params:
            key = "-".join(str(r.params[k]) for k in ("model", "direction") if k in r.params) or r.kind
            series[f"{r.kind}: {key}"].append(r)
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (label, rs) in enumerate(sorted(series.items())):
        rs.sort(key=lambda r: r.params["block_tokens"])
        xs = [r.params["block_tokens"] for r in rs]
        color = f"C{i % 10}"
        ax.plot(xs, [r.gbps for r in rs], "o-", color=color, label=f"kvplane {label}")
        ax.plot(xs, [r.baseline_gbps for r in rs], "s--", color=color, alpha=0.5, label=f"baseline ({rs[0].baseline})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per block")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
