"""Re-layout on the destination: staged source blocks -> the destination cache, with tensor ops.

Used when bytes cannot move directly (see ``planner``). Both sides are brought to one canonical form,
``(tokens, heads, row)``: staged token-major blocks are reshaped, head-major ones permuted, and each spec slot is
the columns its ``SlotPart`` names (K and V halves of a packed row, ``kv_c`` and ``k_pe`` of a fused MLA row). The request's tokens and the transfer's heads are copied across, and the
touched destination blocks are written back. Runs on the destination's device; no per-block Python loop.
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
    """``(n, ...block)`` in memory order -> ``(n * tokens_per_block, heads, width)``, a fresh contiguous tensor."""
    n = blocks.shape[0]
    if order == "HND":
        return blocks.reshape(n, heads, -1, width).permute(0, 2, 1, 3).reshape(-1, heads, width).contiguous()
    return blocks.reshape(n, -1, heads, width).reshape(-1, heads, width).clone()


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
        for p in r.parts:
            cols = slice(p.offset // isz, (p.offset + p.nbytes) // isz)
            src[p.slot] = tok[:tokens, lo - part.head_start : hi - part.head_start, cols]
    t0 = staged.dst_token_start
    ids = torch.as_tensor(staged.dst_block_ids[: -(-(t0 + tokens) // staged.dst_tokens_per_block)])
    d0 = staged.dst_head_start
    for st in dst_layout.slot_tensors(dst_layer, staged.dst_tokens_per_block, dst_value):
        index = ids.to(st.tensor.device)
        blocks = st.tensor.index_select(0, index)  # (n, tokens, heads, row), contiguous
        rows = blocks.view(-1, st.heads, st.row_elems)  # a view: writes reach ``blocks``
        for name, offset, width in st.parts:
            if name not in src:
                raise PlanError(f"layer {staged.layer_name!r}: the source has no slot {name!r} to fill it from")
            rows[t0 : t0 + tokens, lo - d0 : hi - d0, offset : offset + width] = src[name].to(rows.device)
        st.tensor.index_copy_(0, index, blocks)
