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

from kvplane.descriptors import CopyPlan, Region
from kvplane.errors import PlanError, SpecError
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import LayerSpec
from kvplane.plan.heads import head_range, overlap
from kvplane.plan.tokens import Chunks, token_chunks

I64 = npt.NDArray[np.int64]
REPLICATED_FAMILIES = frozenset({"mla", "index"})


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


def _direct_ok(s: Region, d: Region, heads: tuple[int, int]) -> bool:
    if s.parts != d.parts or s.order != d.order or s.row_bytes != d.row_bytes:
        return False
    if s.order == "HND":
        return True
    return heads[1] - heads[0] == s.heads == d.heads  # token-major: only whole token rows are contiguous


def _direct(s: Region, d: Region, ch: Chunks, heads: tuple[int, int], s_h0: int, d_h0: int) -> CopyPlan:
    src_blocks, dst_blocks = s.block_addrs(ch.src_block), d.block_addrs(ch.dst_block)
    if s.order == "NHD":
        row_s, row_d = s.heads * s.row_bytes, d.heads * d.row_bytes
        src = src_blocks + ch.src_token * row_s
        dst = dst_blocks + ch.dst_token * row_d
        return CopyPlan(src, dst, np.full(ch.count, ch.tokens * row_s, dtype=np.int64))
    hb = s.row_bytes
    h = np.arange(heads[0], heads[1], dtype=np.int64)
    src = (src_blocks + ch.src_token * hb)[:, None] + ((h - s_h0) * s.tokens_per_block * hb)[None, :]
    dst = (dst_blocks + ch.dst_token * hb)[:, None] + ((h - d_h0) * d.tokens_per_block * hb)[None, :]
    return CopyPlan(src.ravel(), dst.ravel(), np.full(src.size, ch.tokens * hb, dtype=np.int64))


class _Rows:
    """Token-major direct pairs of one KV-cache group: every pair's descriptors in one broadcast, a row per pair.

    Whole token rows line up on both sides, so chunk ``c`` of pair ``p`` is ``tokens x row`` bytes at
    ``addr + block * block_stride + token * row`` on each side; the result is a ``(pairs, chunks)`` matrix that
    ``CopyPlan.merge_parallel`` semantics then interleave block-major where the layers sit side by side.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[Region, Region]] = []

    def add(self, s: Region, d: Region) -> None:
        self.pairs.append((s, d))

    def plan(self, ch: Chunks) -> CopyPlan:
        cols = np.array([(s.addr, s.block_stride, s.heads * s.row_bytes, d.addr, d.block_stride, d.heads * d.row_bytes)
                         for s, d in self.pairs], dtype=np.int64)
        for side, blocks, k in (("src", ch.src_block, 0), ("dst", ch.dst_block, 1)):
            limit = min(pair[k].num_blocks for pair in self.pairs)
            if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= limit):
                for pair in self.pairs:  # the first region that cannot hold them names the id
                    pair[k].block_addrs(blocks)
        src = cols[:, :1] + ch.src_block[None, :] * cols[:, 1:2] + ch.src_token[None, :] * cols[:, 2:3]
        dst = cols[:, 3:4] + ch.dst_block[None, :] * cols[:, 4:5] + ch.dst_token[None, :] * cols[:, 5:6]
        length = np.broadcast_to(ch.tokens * cols[:, 2:3], src.shape)
        side_by_side = src.shape[0] > 1 and bool(
            ((src[1:, 0] == src[:-1, 0] + length[:-1, 0]) & (dst[1:, 0] == dst[:-1, 0] + length[:-1, 0])).any())
        if side_by_side:
            return CopyPlan(src.ravel("F"), dst.ravel("F"), np.ascontiguousarray(length).ravel("F"))
        return CopyPlan(src.ravel(), dst.ravel(), np.ascontiguousarray(length).ravel())


def _by_layer(manifest: Manifest) -> dict[str, list[Region]]:
    out: dict[str, list[Region]] = {}
    for r in manifest.regions:
        out.setdefault(r.layer_name, []).append(r)
    return out


def _describe(regions: list[Region]) -> str:
    """A layer's regions as a person reads them: ``k+v rows of 512 B x 8 heads, NHD``."""
    return "; ".join(f"{r.slot} rows of {r.row_bytes} B x {r.heads} heads, {r.order}" for r in regions)


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
    on the destination; it is needed only when some layer must be staged (``staging_bytes_needed`` says how
    much), and a plan that needs more raises ``PlanError`` naming the size.
    """
    names = list(layers) if layers is not None else dst.spec.layer_names
    rows: dict[int, _Rows] = {}  # per KV-cache group: token-major direct pairs, computed in one broadcast
    direct: dict[int, list[CopyPlan]] = {}  # per group: head-run plans (HND), merged across layers
    parts: list[CopyPlan] = []
    staged: list[StagedLayer] = []
    direct_bytes = expected_direct = staging_used = staged_bytes = 0
    staging_addr, staging_size = staging if staging is not None else (0, 0)
    chunks_of: dict[int, Chunks] = {}
    s_index, d_index = _by_layer(src), _by_layer(dst)
    d_layers = {layer.name: layer for layer in dst.spec.layers}
    s_layers = {layer.name: layer for layer in src.spec.layers}
    for name in names:
        d_layer = d_layers[name] if name in d_layers else dst.spec.layer(name)  # the latter raises, naming it
        s_layer = s_layers[name] if name in s_layers else _src_layer(src, name)
        group = d_layer.group_id
        if group not in chunks_of:
            chunks_of[group] = _chunks(src, dst, src_block_ids, dst_block_ids, num_tokens, group)
        ch = chunks_of[group]
        replicated = d_layer.family in REPLICATED_FAMILIES
        s_regions, d_regions = s_index.get(name, []), d_index.get(name, [])
        if not s_regions or not d_regions:
            raise PlanError(f"layer {name!r} has no regions in the {'source' if not s_regions else 'destination'} "
                            f"manifest; both sides must register every layer they plan")
        s_h0 = head_range(src.rank, s_regions[0].heads, replicated)[0]
        d_h0 = head_range(dst.rank, d_regions[0].heads, replicated)[0]
        heads = overlap((s_h0, s_h0 + s_regions[0].heads), (d_h0, d_h0 + d_regions[0].heads))
        if heads[0] >= heads[1] or ch.count == 0:
            continue  # this source rank holds none of the heads this destination rank needs
        by_slot = {r.slot: r for r in s_regions}
        pairs = [(by_slot[d.slot], d) for d in d_regions if d.slot in by_slot]
        if len(pairs) == len(d_regions) and all(_direct_ok(s, d, heads) for s, d in pairs):
            for s, d in pairs:
                expected_direct += ch.count * ch.tokens * (heads[1] - heads[0]) * d.row_bytes
                if s.order == "NHD":
                    rows.setdefault(group, _Rows()).add(s, d)
                    continue
                part = _direct(s, d, ch, heads, s_h0, d_h0)
                direct.setdefault(group, []).append(part)
                direct_bytes += part.total_bytes
            continue
        n_src = -(-num_tokens[group] // s_regions[0].tokens_per_block)
        src_ids = np.asarray(src_block_ids[group], dtype=np.int64)[:n_src]
        sources = []
        for s in s_regions:
            start = staging_used
            staging_used += n_src * s.block_bytes
            dst_addrs = staging_addr + start + np.arange(n_src, dtype=np.int64) * s.block_bytes
            parts.append(CopyPlan(s.block_addrs(src_ids), dst_addrs, np.full(n_src, s.block_bytes, np.int64)))
            staged_bytes += n_src * s.block_bytes
            sources.append(StagedRegion(s, start, n_src, s_h0))
        staged.append(
            StagedLayer(
                layer_name=name,
                src_layer=s_layer,
                sources=tuple(sources),
                dst_block_ids=np.asarray(dst_block_ids[group], dtype=np.int64),
                dst_tokens_per_block=d_regions[0].tokens_per_block,
                num_tokens=num_tokens[group],
                heads=heads,
                dst_head_start=d_h0,
            )
        )
    if staging_used > staging_size and staging is not None:
        raise PlanError(f"staging needs {staging_used} B, the buffer given has {staging_size} B; pass a larger one")
    if staging_used and staging is None:
        first = staged[0].layer_name
        raise PlanError(
            f"this transfer must stage {staging_used} B: layouts or TP head slices differ between the sides (layer "
            f"{first!r}: source {src.engine_id} rank {src.rank} has {_describe(s_index[first])}, destination "
            f"{dst.engine_id} rank {dst.rank} has {_describe(d_index[first])}); pass staging=(addr, nbytes) of a "
            f"registered destination buffer"
        )
    for group, pending in rows.items():
        part = pending.plan(chunks_of[group])
        direct.setdefault(group, []).insert(0, part)
        direct_bytes += part.total_bytes
    if direct_bytes != expected_direct:
        raise PlanError(f"plan covers {direct_bytes} B directly but the request needs {expected_direct} B")
    plan = CopyPlan.concat([CopyPlan.merge_parallel(p) for p in direct.values()] + parts).coalesced()
    return TransferPlan(plan, tuple(staged), staging_used, direct_bytes, staged_bytes, tuple(names))


def staging_bytes_needed(
    src: Manifest,
    dst: Manifest,
    src_block_ids: Mapping[int, npt.ArrayLike],
    dst_block_ids: Mapping[int, npt.ArrayLike],
    num_tokens: Mapping[int, int],
    *,
    layers: Sequence[str] | None = None,
) -> int:
    """Bytes of staging buffer ``plan_transfer`` will need for the same arguments."""
    unbounded = (0, 1 << 62)  # addresses are not used, only the size is read
    return plan_transfer(src, dst, src_block_ids, dst_block_ids, num_tokens, layers=layers, staging=unbounded).staging_bytes


def _src_layer(src: Manifest, name: str) -> LayerSpec:
    try:
        return src.spec.layer(name)
    except SpecError:
        raise PlanError(f"layer {name!r} is not in the source manifest ({src.engine_id} rank {src.rank})") from None


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
