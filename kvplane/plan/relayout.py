"""Re-layout on the destination: staged source blocks -> the destination cache, with tensor ops.

Used when bytes cannot move directly (see ``planner``). Both sides are brought to one canonical form,
``(tokens, heads, row)``: staged token-major blocks are reshaped, head-major ones permuted, and each spec slot is
the columns its ``SlotPart`` names (K and V halves of a packed row, ``kv_c`` and ``k_pe`` of a fused MLA row). The
staged side is only viewed (never copied); each slot part is written into the destination cache with one indexed
assignment over (block, token) index arrays, so the bytes are read once and written once. Runs on the destination's
device; no per-block Python loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.errors import PlanError
from kvplane.kv.layouts import LayerValue, Layout
from kvplane.kv.layouts.base import torch_dtype
from kvplane.kv.spec import LayerSpec
from kvplane.plan.planner import StagedLayer

if TYPE_CHECKING:
    import torch


def _to_tokens(blocks: torch.Tensor, order: str, heads: int, width: int) -> torch.Tensor:
    """``(n, ...block)`` in memory order -> ``(n, tokens_per_block, heads, width)``, a view of the staged bytes."""
    n = blocks.shape[0]
    if order == "HND":
        return blocks.view(n, heads, -1, width).permute(0, 2, 1, 3)
    return blocks.view(n, -1, heads, width)


def apply_relayout(
    staged: StagedLayer,
    staging: torch.Tensor,
    dst_layer: LayerSpec,
    dst_layout: Layout,
    dst_value: LayerValue,
) -> None:
    """Copy one staged layer from ``staging`` (uint8, the whole staging buffer) into the destination cache."""
    import torch

    lo, hi = staged.heads
    tokens = staged.num_tokens
    src: dict[str, torch.Tensor] = {}
    for part in staged.sources:
        r = part.region
        dtype = torch_dtype(staged.src_layer.slot(r.parts[0].slot).dtype)
        raw = staging[part.offset : part.offset + part.num_blocks * r.block_bytes].view(dtype)
        isz = raw.element_size()
        tok = _to_tokens(raw.view(part.num_blocks, -1), r.order, r.heads, r.row_bytes // isz)
        rows = tok.reshape(-1, r.heads, r.row_bytes // isz)  # a view where blocks are token-major (NHD)
        for p in r.parts:
            cols = slice(p.offset // isz, (p.offset + p.nbytes) // isz)
            src[p.slot] = rows[:tokens, lo - part.head_start : hi - part.head_start, cols]
    d0, t0, per_block = staged.dst_head_start, staged.dst_token_start, staged.dst_tokens_per_block
    ids = torch.as_tensor(staged.dst_block_ids[: -(-(t0 + tokens) // per_block)])
    at = torch.arange(t0, t0 + tokens)
    blocks, offsets = ids[at // per_block], at % per_block  # each token's destination block and place in it
    for st in dst_layout.slot_tensors(dst_layer, per_block, dst_value):
        block, token = blocks.to(st.tensor.device), offsets.to(st.tensor.device)
        for name, offset, width in st.parts:
            if name not in src:
                raise PlanError(f"layer {staged.layer_name!r}: the source has no slot {name!r} to fill it from")
            # (tokens, heads, width) into (block, token) pairs: one pass over the bytes, written in place
            st.tensor[block, token, lo - d0 : hi - d0, offset : offset + width] = src[name].to(st.tensor.device)
