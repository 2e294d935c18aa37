"""Re-layout on the destination: staged source blocks -> the destination cache, with tensor ops.

Used when bytes cannot move directly (see ``planner``). Both sides are brought to one canonical form per spec
slot, ``(tokens, heads, head_dim)``: token-major blocks are reshaped, head-major ones permuted, fused MLA rows
split into ``kv_c`` and ``k_pe``. The request's tokens and the transfer's heads are copied across, and the
touched destination blocks are written back. Runs on the destination's device; no per-block Python loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.errors import PlanError
from kvplane.kv.layouts import LayerValue, Layout
from kvplane.kv.layouts.base import torch_dtype
from kvplane.kv.spec import LayerSpec, SlotSpec
from kvplane.plan.planner import StagedLayer

if TYPE_CHECKING:
    import torch


def _components(layer: LayerSpec, slot: str) -> list[SlotSpec]:
    return [layer.slot(name) for name in slot.split("+")]


def _to_tokens(blocks: torch.Tensor, order: str, heads: int, width: int) -> torch.Tensor:
    """``(n, ...block)`` -> ``(n * tokens_per_block, heads, width)``, a fresh contiguous tensor."""
    n = blocks.shape[0]
    if order == "HND":
        return blocks.reshape(n, heads, -1, width).permute(0, 2, 1, 3).reshape(-1, heads, width).contiguous()
    return blocks.reshape(n, -1, heads, width).reshape(-1, heads, width).clone()


def _from_tokens(tokens: torch.Tensor, order: str, like: torch.Tensor) -> torch.Tensor:
    n, heads, width = like.shape[0], tokens.shape[1], tokens.shape[2]
    if order == "HND":
        return tokens.reshape(n, -1, heads, width).permute(0, 2, 1, 3).reshape(like.shape)
    return tokens.reshape(like.shape)


def _split(tokens: torch.Tensor, comps: list[SlotSpec]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for c in comps:
        out[c.name] = tokens[..., start : start + c.head_dim]  # views: writes reach ``tokens``
        start += c.head_dim
    return out


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
        comps = _components(staged.src_layer, r.slot)
        dtype = torch_dtype(comps[0].dtype)
        raw = staging[part.offset : part.offset + part.num_blocks * r.block_bytes].view(dtype)
        width = r.head_bytes // raw.element_size()
        tok = _to_tokens(raw.view(part.num_blocks, -1), r.order, r.heads, width)
        for name, t in _split(tok, comps).items():
            src[name] = t[:tokens, lo - part.head_start : hi - part.head_start]
    ids = torch.as_tensor(staged.dst_block_ids[: -(-tokens // staged.dst_tokens_per_block)])
    for st in dst_layout.slot_tensors(dst_layer, staged.dst_tokens_per_block, dst_value):
        blocks = st.tensor.index_select(0, ids.to(st.tensor.device))
        tok = _to_tokens(blocks, dst_layout.order, st.heads, st.head_elems)
        for name, view in _split(tok, _components(dst_layer, st.slot)).items():
            if name not in src:
                raise PlanError(f"layer {staged.layer_name!r}: the source has no slot {name!r} to fill it from")
            d0 = staged.dst_head_start
            view[:tokens, lo - d0 : hi - d0] = src[name].to(view.device)
        st.tensor.index_copy_(0, ids.to(st.tensor.device), _from_tokens(tok, dst_layout.order, blocks))
