"""The planner: two manifests + block ids -> a ``TransferPlan`` (descriptor arrays plus staged re-layouts).

Per layer, each destination region is paired with the source region holding the same slots. A pair moves
**directly** when its bytes line up chunk by chunk: the same rows (slot parts, row bytes) in the same memory
order, token-major blocks holding the same heads on both sides, or head-major (HND) blocks, where a head slice
of a block is contiguous. Direct descriptors of all layers are built per layer and merged block-major where the
layers of a block sit side by side on both sides (cross-layer caches): one descriptor per block for all layers. Block sizes may differ (chunks of
``gcd`` tokens). Anything else (a head slice of token-major blocks under heterogeneous TP, fused MLA against
split nope/rope, token-major against head-major) is **staged**: whole source blocks land in a staging buffer on
the destination and ``plan.relayout`` re-lays them out there with tensor ops. No descriptor is ever per token,
and every array is built with numpy, never a Python loop per block.

Coverage is checked before a plan is returned: the direct bytes must equal what the request's tokens x heads
need, so a plan never silently moves less than it should.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import HOLE
from kvplane.descriptors import CopyPlan, Region
from kvplane.descriptors import Int64Array as I64
from kvplane.errors import PlanError
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import LayerSpec
from kvplane.plan.pairing import REPLICATED_FAMILIES, Pairing, describe, head_major_plan
from kvplane.plan.pairing import pairing as pairing_of
from kvplane.plan.tokens import Chunks, token_chunks

__all__ = ["REPLICATED_FAMILIES", "StagedLayer", "StagedRegion", "TransferPlan", "plan_transfer"]

@dataclass(frozen=True)
class StagedRegion:
    """Whole source blocks of one source region, placed at ``offset`` in the staging buffer."""

    region: Region
    offset: int
    num_blocks: int
    head_start: int  # global id of the region's first head


@dataclass(frozen=True)
class StagedLayer:
    """What the destination must re-lay out for one layer once the staged bytes have landed."""

    layer_name: str
    src_layer: LayerSpec
    sources: tuple[StagedRegion, ...]
    dst_block_ids: I64
    dst_tokens_per_block: int
    num_tokens: int
    heads: tuple[int, int]  # global head ids [lo, hi) this transfer fills
    dst_head_start: int
    dst_token_start: int = 0  # where the staged tokens begin in ``dst_block_ids[0]`` (a chunk of a request)


@dataclass(frozen=True)
class TransferPlan:
    plan: CopyPlan  # src addresses on the source rank, dst on the destination rank (or its staging buffer)
    staged: tuple[StagedLayer, ...] = ()
    staging_bytes: int = 0
    direct_bytes: int = 0
    staged_bytes: int = 0  # staging bytes moved (whole source blocks)
    layers: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return self.plan.total_bytes


def plan_transfer(
    src: Manifest,
    dst: Manifest,
    src_block_ids: Mapping[int, npt.ArrayLike],
    dst_block_ids: Mapping[int, npt.ArrayLike],
    num_tokens: Mapping[int, int],
    *,
    layers: Sequence[str] | None = None,
    staging: tuple[int, int] | None = None,
) -> TransferPlan:
    """Plan moving a request's KV from ``src``'s rank to ``dst``'s rank.

    Block ids and token counts are per KV-cache group. ``staging`` is ``(addr, nbytes)`` of a registered buffer
    on the destination; it is needed only when some layer must be staged (``staging_bytes`` of a plan made with
    room to spare, ``staging=(0, 1 << 62)``, says how much), and a plan that needs more raises ``PlanError`` naming the size.

    How each layer's regions pair up depends only on the two manifests and the layer list, so it is worked
    out once per manifest pair (kept for the last 64 pairs); per request only arrays over blocks are built.
    """
    pairing = pairing_of(src, dst, layers)
    names = list(layers) if layers is not None else dst.spec.layer_names
    chunks_of = {g: _chunks(src, dst, src_block_ids, dst_block_ids, num_tokens, g) for g in pairing.groups}
    expected_direct = sum(chunks_of[g].count * chunks_of[g].tokens * per_token
                          for g, per_token in pairing.row_bytes.items())
    direct, direct_bytes, rows_only = _direct_parts(pairing, chunks_of)
    staging_addr, staging_size = staging if staging is not None else (0, 0)
    parts, staged, staging_used = _staged_parts(pairing, chunks_of, src_block_ids, dst_block_ids, num_tokens,
                                                staging_addr)
    if staging_used > staging_size and staging is not None:
        raise PlanError(f"staging needs {staging_used} B, the buffer given has {staging_size} B; pass a larger one")
    if staging_used and staging is None:
        first = pairing.staged[0]
        raise PlanError(
            f"this transfer must stage {staging_used} B: layouts or TP head slices differ between the sides (layer "
            f"{first.name!r}: source {src.engine_id} rank {src.rank} has {describe(first.s_regions)}, destination "
            f"{dst.engine_id} rank {dst.rank} has {describe(first.d_regions)}); pass staging=(addr, nbytes) of a "
            f"registered destination buffer"
        )
    if direct_bytes != expected_direct:
        raise PlanError(f"plan covers {direct_bytes} B directly but the request needs {expected_direct} B")
    every = direct + parts
    if rows_only and len(every) == 1:
        plan = every[0]
    else:
        plan = CopyPlan.concat(every).coalesced() if every else CopyPlan.empty()
    return TransferPlan(plan, tuple(staged), staging_used, direct_bytes, staging_used, tuple(names))


def _direct_parts(pairing: Pairing, chunks_of: Mapping[int, Chunks]) -> tuple[list[CopyPlan], int, bool]:
    """The direct descriptors (coalesced per token-major group, merged per head-major group), their bytes, and
    whether they are one token-major group's alone (then already final)."""
    direct: list[CopyPlan] = []
    direct_bytes = 0
    for group, rows in pairing.rows.items():
        ch = chunks_of[group]
        if ch.count:
            part = rows.plan(ch)  # coalesced already
            direct.append(part)
            direct_bytes += part.total_bytes
    rows_only = len(direct) == 1 and not pairing.hnd
    hnd_by_group: dict[int, list[CopyPlan]] = {}
    for x in pairing.hnd:
        ch = chunks_of[x.group]
        if ch.count:
            part = head_major_plan(x.src, x.dst, ch, x.heads, x.s_h0, x.d_h0)
            hnd_by_group.setdefault(x.group, []).append(part)
            direct_bytes += part.total_bytes
    direct += [CopyPlan.merge_parallel(p) for p in hnd_by_group.values()]
    return direct, direct_bytes, rows_only


def _staged_parts(pairing: Pairing, chunks_of: Mapping[int, Chunks], src_block_ids: Mapping[int, npt.ArrayLike],
                  dst_block_ids: Mapping[int, npt.ArrayLike], num_tokens: Mapping[int, int], staging_addr: int
                  ) -> tuple[list[CopyPlan], list[StagedLayer], int]:
    """Whole source blocks of every staged layer into the staging buffer at ``staging_addr``, one after the other:
    (their descriptors, what the destination re-lays out, staging bytes used)."""
    parts: list[CopyPlan] = []
    staged: list[StagedLayer] = []
    used = 0
    for st in pairing.staged:
        if chunks_of[st.group].count == 0:
            continue
        n_src = -(-num_tokens[st.group] // st.s_regions[0].tokens_per_block)
        src_ids = np.asarray(src_block_ids[st.group], dtype=np.int64)[:n_src]
        if (src_ids == HOLE).any() or (np.asarray(dst_block_ids[st.group]) == HOLE).any():
            raise PlanError(
                f"layer {st.name!r} must be staged (layouts or TP head slices differ between the sides) and group "
                f"{st.group}'s block ids have holes ({HOLE}: positions out of a sliding window); staged re-layout "
                f"moves whole requests only: give both sides the same layout and TP size for this model"
            )
        sources = []
        for s in st.s_regions:
            dst_addrs = staging_addr + used + np.arange(n_src, dtype=np.int64) * s.block_bytes
            parts.append(CopyPlan(s.block_addrs(src_ids), dst_addrs, np.full(n_src, s.block_bytes, np.int64)))
            sources.append(StagedRegion(s, used, n_src, st.s_h0))
            used += n_src * s.block_bytes
        staged.append(StagedLayer(
            layer_name=st.name, src_layer=st.src_layer, sources=tuple(sources),
            dst_block_ids=np.asarray(dst_block_ids[st.group], dtype=np.int64),
            dst_tokens_per_block=st.d_regions[0].tokens_per_block, num_tokens=num_tokens[st.group], heads=st.heads,
            dst_head_start=st.d_h0,
        ))
    return parts, staged, used


def _chunks(
    src: Manifest,
    dst: Manifest,
    src_block_ids: Mapping[int, npt.ArrayLike],
    dst_block_ids: Mapping[int, npt.ArrayLike],
    num_tokens: Mapping[int, int],
    group: int,
) -> Chunks:
    for what, mapping in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids),
                          ("num_tokens", num_tokens)):
        if group not in mapping:
            raise PlanError(f"{what} has no entry for KV-cache group {group}; pass one per group the layers use")
    return token_chunks(
        num_tokens[group],
        np.asarray(src_block_ids[group], dtype=np.int64),
        src.spec.group(group).tokens_per_block,
        np.asarray(dst_block_ids[group], dtype=np.int64),
        dst.spec.group(group).tokens_per_block,
        f"group {group}",
    )
