"""The bench catalog: every scenario ``kvplane bench`` runs, listed here and nowhere else.

Cross-layer rows (suffix ``-xl``): the same request over vLLM's one tensor for all layers, beside the per-layer
row; the default run has DeepSeek-V3's offload store/load (61 layers: the most descriptors saved) and a 1k-token
P/D pull of Qwen3 per engine and a cross-vendor P/D pull (``pd_vendors``: a prefill holding Ascend's caches, a
decode holding CUDA's, against a same-vendor pair), the full run adds Qwen3's offload rows, P/D READ/WRITE between processes at 10k
tokens and the push modes.

``DEFAULT`` is a plain ``kvplane bench`` (about 2 minutes on 2 cores): one representative row per kind and
model. ``full()`` is ``--full``: the default rows at full size plus the sweeps (block sizes, raw transports,
block-id patterns, big store and plan sizes) and the engine-call latency rows (``get_finished`` while 2 GiB
move, per engine: six 2 GiB pulls each, 3 min 46 s for both on a loaded machine: more than the
default run can spare), then the live-serving rows (kind ``serve``, ``kvplane.bench.serve.rows``: P/D per mode
and engine against one plain vLLM instance, and the host-tier hit against a miss, in real ``vllm serve``
processes; server starts are reported apart from the figures). The serve rows are listed only where a serving
Python is found (``$KVPLANE_SERVE_PYTHON``, else the checkout's ``.venv-serve``), as the store rows are only where
Mooncake Store imports. Scenario modules only offer factories; nothing registers on import.

Layouts: every factory takes ``layouts`` (default: the backend's own) and a name ``variant``. To measure
another layout beside the default one (cross-layer blocks), add an entry to ``LAYOUT_VARIANTS``: its rows are
appended to both lists, named with the suffix.
"""

from __future__ import annotations

from kvplane.bench import (
    descriptor_sweep,
    engine_calls,
    local_copy,
    offload,
    overhead,
    pd,
    pd_flow,
    pd_vendors,
    plan_build,
    store,
)
from kvplane.bench.block_ids import Pattern
from kvplane.bench.scenario import Scenario
from kvplane.bench.serve import rows as serve
from kvplane.errors import KvplaneError

MODELS = ("qwen3-0.6b", "deepseek-v3")
ENGINES = ("mooncake", "nixl")
DEFAULT_PD_TOKENS = 1_000  # the default run's P/D rows (fixed costs dominate its time); --full: 10k

PATTERNS: tuple[Pattern, ...] = ("scatter", "runs")  # block ids: random, or a fresh request's runs
XL = "-xl"  # the name suffix of a row over vLLM's cross-layer tensors (one tensor for all layers, both sides)

# (name suffix, layouts by family): extra layouts measured beside the backend's own, e.g.
# ("-xl", {"gqa": "<cross-layer gqa layout>", "mla": "<cross-layer mla layout>"})
LAYOUT_VARIANTS: tuple[tuple[str, dict[str, str]], ...] = ()


def _rows(layouts: dict[str, str] | None, variant: str, full: bool) -> list[Scenario]:
    pd_tokens = None if full else DEFAULT_PD_TOKENS
    rows: list[Scenario] = []
    for m in MODELS:
        rows += [offload.scenario(m, d, layouts, variant) for d in ("store", "load")]
        if not variant and (full or m == "deepseek-v3"):  # over cross-layer tensors, after the per-layer rows
            rows += [offload.scenario(m, d, variant=XL, cross_layer=True) for d in ("store", "load")]
    for m in MODELS:
        rows += [overhead.scenario(m, d, layouts, variant) for d in ("store", "load")]
    for e in ENGINES:
        for m in MODELS:
            rows += [pd_flow.scenario(e, m, mode, "scatter", layouts, variant, pd_tokens) for mode in pd_flow.MODES]
        if not variant:
            rows.append(pd_flow.scenario(e, MODELS[0], "pull", variant=XL, tokens=pd_tokens, cross_layer=True))
    if not variant:  # Ascend's caches feeding CUDA's, against a same-vendor pair
        modes: tuple[pd_flow.Mode, ...] = ("pull", "push") if full else ("pull",)
        pairs = [(e, m) for e in ENGINES for m in MODELS] if full else [(ENGINES[0], MODELS[0])]
        rows += [pd_vendors.scenario(e, m, mode, DEFAULT_PD_TOKENS) for e, m in pairs for mode in modes]
    if store.available():
        for m in MODELS:
            rows += [store.scenario(m, op, layouts=layouts, variant=variant) for op in ("put", "get")]
    if not variant:
        rows += [plan_build.scenario(m, 10_000) for m in MODELS]
    return rows


def _sweeps(layouts: dict[str, str] | None, variant: str) -> list[Scenario]:
    rows: list[Scenario] = []
    for m in MODELS:
        for d in ("d2h", "h2d"):
            rows += [local_copy.scenario(m, d, bt, layouts, variant) for bt in local_copy.BLOCK_TOKENS]
            if not variant:  # over vLLM's cross-layer tensor: the GPU run's offload rows (docs/gpu.md)
                rows += [local_copy.scenario(m, d, bt, variant=XL, cross_layer=True) for bt in (16, 64)]
    if not variant:  # descriptor sizes by every copy route (descriptor_sweep)
        rows += [descriptor_sweep.scenario(d, kib) for d in ("d2h", "h2d") for kib in descriptor_sweep.SIZES_KIB]
    for e in ENGINES:
        for m in MODELS:
            for pattern in PATTERNS:
                rows += [pd.scenario(e, m, op, pattern, layouts, variant) for op in ("READ", "WRITE")]
            if not variant:  # between processes over cross-layer tensors (the 2x goal is Qwen3's 10k READ here),
                # with scattered block ids and with a fresh request's runs (consecutive blocks coalesce further)
                for xl_ids in PATTERNS:
                    rows += [pd.scenario(e, m, op, xl_ids, variant=XL, cross_layer=True) for op in ("READ", "WRITE")]
                rows += [pd_flow.scenario(e, m, mode, variant=XL, cross_layer=True) for mode in ("push", "layerwise")]
            rows += [pd_flow.scenario(e, m, mode, "runs", layouts, variant) for mode in pd_flow.MODES]
        if not variant:  # both caches in device memory, two processes (the GPU run's P/D rows, docs/gpu.md)
            rows += [pd.scenario(e, MODELS[0], op, vram=True) for op in ("READ", "WRITE")]
    if store.available():
        for m in MODELS:
            rows += [store.scenario(m, op, store.BIG_TOKENS, layouts, variant) for op in ("put", "get")]
    if not variant:
        rows += [plan_build.scenario(m, 100_000) for m in MODELS]
        rows += [engine_calls.scenario(e) for e in ENGINES]  # get_finished while 2 GiB move (issue 12)
    return rows


def default() -> list[Scenario]:
    rows = _rows(None, "", full=False)
    for suffix, layouts in LAYOUT_VARIANTS:
        rows += _rows(layouts, suffix, full=False)
    return rows


def full() -> list[Scenario]:
    rows = _rows(None, "", full=True) + _sweeps(None, "")
    for suffix, layouts in LAYOUT_VARIANTS:
        rows += _rows(layouts, suffix, full=True) + _sweeps(layouts, suffix)
    if serve.available():  # live vLLM servers, last: their starts cost minutes
        rows += serve.scenarios()
    return rows


def select(names: list[str] | None, full_run: bool = False) -> list[Scenario]:
    """The scenarios a run asks for: a named one runs at the default run's size unless ``full_run``."""
    if not names:
        return full() if full_run else default()
    known = {s.name: s for s in full()}
    if not full_run:
        known.update({s.name: s for s in default()})
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KvplaneError(f"--scenario {unknown[0]!r} is unknown; choose from: {', '.join(known)}")
    return [known[n] for n in names]
