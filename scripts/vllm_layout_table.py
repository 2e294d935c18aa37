"""Print docs/vllm.md's table of vLLM attention backends kvplane serves and refuses, from the tests' own discovery.

Run with the vLLM to document installed: ``.venv/bin/python scripts/vllm_layout_table.py``. Each row is what
tests/vllm/test_vllm_layouts.py checks: the backend's tensor built by vLLM's own shape functions, then the layout
kvplane reads from it, or the start of the LayoutError that refuses it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests" / "unit")]

import test_vllm_layouts as checks  # noqa: E402
import vllm_kv_tensors as vkt  # noqa: E402


def main() -> None:
    print(f"vLLM {vkt.vllm_version()}: {len(checks.CASES)} attention backend classes with a KV shape\n")
    print("| backend class | name | kvplane | logical shape (probe) |")
    print("|---|---|---|---|")
    for case in checks.CASES:
        verdict, detail = checks.served_or_refused(case)
        block, heads, head, cache_dtype = checks.params(case)
        shape = vkt.kv_cache_shape(case.cls, 7, block, heads, head, cache_dtype)
        what = f"`{detail}`" if verdict == "served" else "refused: " + detail.split(" for num_blocks")[0].split(
            " allocates ")[-1]
        print(f"| `{case.id}` | {case.name} | {what} | `{shape}` (nb=7, bs={block}, h={heads}, d={head}, "
              f"{cache_dtype}) |")
    others = [c for c in vkt.discover() if c.kind != vkt.KV]
    print("\nNot attention KV, or not importable on this machine (no CUDA, no flashinfer):\n")
    for case in others:
        print(f"- `{case.id}`: {case.kind}: {(case.error or '').splitlines()[0][:110]}")


if __name__ == "__main__":
    main()
