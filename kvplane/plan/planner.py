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

import importlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import HOLE
from kvplane.descriptors import CopyPlan, Region
from kvplane.descriptors import Int64Array as I64
from kvplane.errors import PlanError, SpecError
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import LayerSpec
from kvplane.plan.heads import head_range, overlap
from kvplane.plan.tokens import Chunks, token_chunks

REPLICATED_FAMILIES = frozenset({"mla", "index"})

_native: ModuleType | None
try:  # the C pass the offload planner uses too (kvplane/_native/memcpy.c); numpy where it is not built
    _native = importlib.import_module("kvplane._native._memcpy")
except ImportError:
    _native = None


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
    ``addr + block * block_stride + token * row`` on each side. Where the layers sit side by side (cross-layer
    caches) the ``(pairs, chunks)`` matrix is read block-major, so that coalescing makes one descriptor per
    block for all layers; otherwise pair by pair. Chunks that are whole blocks on both sides (equal block sizes)
    go through the native ``plan_blocks`` pass (addresses and coalescing in one C loop) where it is built.
    """

    def __init__(self, pairs: list[tuple[Region, Region]]) -> None:
        self.pairs = pairs
        self.cols = np.array([(s.addr, s.block_stride, s.heads * s.row_bytes, d.addr, d.block_stride,
                               d.heads * d.row_bytes) for s, d in pairs], dtype=np.int64)
        self.limits = (min(s.num_blocks for s, _ in pairs), min(d.num_blocks for _, d in pairs))
        c = self.cols
        # layers side by side on both sides: pair p + 1 starts where pair p's block ends (block-major order)
        self.side_by_side = len(pairs) > 1 and bool(((c[1:, 0] == c[:-1, 0] + c[:-1, 2] * pairs[0][0].tokens_per_block)
                                                     & (c[1:, 3] == c[:-1, 3] + c[:-1, 5] * pairs[0][1].tokens_per_block)
                                                     ).any())
        self.native_cols = np.ascontiguousarray(c[:, [0, 1, 3, 4]].T)
        self.bounds = np.array([0, len(pairs)], dtype=np.int64)  # one "layer": descriptors merge anywhere

    def plan(self, ch: Chunks) -> CopyPlan:
        for side, blocks, k in (("src", ch.src_block, 0), ("dst", ch.dst_block, 1)):
            if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= self.limits[k]):
                for pair in self.pairs:  # the first region that cannot hold them names the id
                    pair[k].block_addrs(blocks)
        c = self.cols
        whole_blocks = not (ch.src_token.any() or ch.dst_token.any())
        if whole_blocks and not self.side_by_side and _native is not None and hasattr(_native, "plan_blocks"):
            n = ch.count * len(self.pairs)
            out = np.empty((3, n), dtype=np.int64)
            bounds = np.empty(2, dtype=np.int64)
            length = np.ascontiguousarray(ch.tokens * c[:, 2])
            nc = self.native_cols
            count = _native.plan_blocks(nc[0], nc[1], nc[2], nc[3], length, self.bounds,
                                        np.ascontiguousarray(ch.src_block), np.ascontiguousarray(ch.dst_block),
                                        out[0], out[1], out[2], bounds)
            return CopyPlan(out[0, :count], out[1, :count], out[2, :count])
        src = c[:, :1] + ch.src_block[None, :] * c[:, 1:2] + ch.src_token[None, :] * c[:, 2:3]
        dst = c[:, 3:4] + ch.dst_block[None, :] * c[:, 4:5] + ch.dst_token[None, :] * c[:, 5:6]
        length = np.broadcast_to(ch.tokens * c[:, 2:3], src.shape)
        if self.side_by_side:
            return CopyPlan(src.ravel("F"), dst.ravel("F"), np.ascontiguousarray(length).ravel("F")).coalesced()
        return CopyPlan(src.ravel(), dst.ravel(), np.ascontiguousarray(length).ravel()).coalesced()


@dataclass(frozen=True)
class _Direct:
    """A head-major (HND) direct pair: head runs, built per request with ``_direct``."""

    group: int
    src: Region
    dst: Region
    heads: tuple[int, int]
    s_h0: int
    d_h0: int


@dataclass(frozen=True)
class _Staged:
    """A layer whose bytes must be staged: its regions on both sides and the heads it fills."""

    name: str
    group: int
    src_layer: LayerSpec
    s_regions: list[Region]
    d_regions: list[Region]
    heads: tuple[int, int]
    s_h0: int
    d_h0: int


@dataclass
class _Pairing:
    """What a transfer between two manifests does per layer, worked out once: which pairs move directly (token-
    major rows per group, head-major pairs) and which layers are staged. Holds the manifests so that a cached
    pairing is only ever used for the very objects it was built from."""

    src: Manifest
    dst: Manifest
    groups: list[int]  # KV-cache groups the layers use, in first-use order
    rows: dict[int, _Rows]
    hnd: list[_Direct]
    staged: list[_Staged]
    row_bytes: dict[int, int]  # per group: direct bytes per chunk token, over every direct pair


_PAIRINGS: OrderedDict[tuple[int, int, tuple[str, ...] | None], _Pairing] = OrderedDict()
_PAIRINGS_KEPT = 64


def _pairing(src: Manifest, dst: Manifest, layers: Sequence[str] | None) -> _Pairing:
    key = (id(src), id(dst), tuple(layers) if layers is not None else None)
    hit = _PAIRINGS.get(key)
    if hit is not None and hit.src is src and hit.dst is dst:
        _PAIRINGS.move_to_end(key)
        return hit
    pairing = _pair_layers(src, dst, list(layers) if layers is not None else dst.spec.layer_names)
    _PAIRINGS[key] = pairing
    while len(_PAIRINGS) > _PAIRINGS_KEPT:
        _PAIRINGS.popitem(last=False)
    return pairing


def _pair_layers(src: Manifest, dst: Manifest, names: list[str]) -> _Pairing:
    s_index, d_index = _by_layer(src), _by_layer(dst)
    d_layers = {layer.name: layer for layer in dst.spec.layers}
    s_layers = {layer.name: layer for layer in src.spec.layers}
    groups: list[int] = []
    row_pairs: dict[int, list[tuple[Region, Region]]] = {}
    hnd: list[_Direct] = []
    staged: list[_Staged] = []
    row_bytes: dict[int, int] = {}
    for name in names:
        d_layer = d_layers[name] if name in d_layers else dst.spec.layer(name)  # the latter raises, naming it
        s_layer = s_layers[name] if name in s_layers else _src_layer(src, name)
        group = d_layer.group_id
        if group not in groups:
            groups.append(group)
        replicated = d_layer.family in REPLICATED_FAMILIES
        s_regions, d_regions = s_index.get(name, []), d_index.get(name, [])
        if not s_regions or not d_regions:
            raise PlanError(f"layer {name!r} has no regions in the {'source' if not s_regions else 'destination'} "
                            f"manifest; both sides must register every layer they plan")
        s_h0 = head_range(src.rank, s_regions[0].heads, replicated)[0]
        d_h0 = head_range(dst.rank, d_regions[0].heads, replicated)[0]
        heads = overlap((s_h0, s_h0 + s_regions[0].heads), (d_h0, d_h0 + d_regions[0].heads))
        if heads[0] >= heads[1]:
            continue  # this source rank holds none of the heads this destination rank needs
        by_slot = {r.slot: r for r in s_regions}
        pairs = [(by_slot[d.slot], d) for d in d_regions if d.slot in by_slot]
        if len(pairs) == len(d_regions) and all(_direct_ok(s, d, heads) for s, d in pairs):
            for s, d in pairs:
                row_bytes[group] = row_bytes.get(group, 0) + (heads[1] - heads[0]) * d.row_bytes
                if s.order == "NHD":
                    row_pairs.setdefault(group, []).append((s, d))
                else:
                    hnd.append(_Direct(group, s, d, heads, s_h0, d_h0))
            continue
        staged.append(_Staged(name, group, s_layer, s_regions, d_regions, heads, s_h0, d_h0))
    rows = {g: _Rows(pairs) for g, pairs in row_pairs.items()}
    return _Pairing(src, dst, groups, rows, hnd, staged, row_bytes)


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

    How each layer's regions pair up depends only on the two manifests and the layer list, so it is worked
    out once per manifest pair (kept for the last 64 pairs); per request only arrays over blocks are built.
    """
    pairing = _pairing(src, dst, layers)
    names = list(layers) if layers is not None else dst.spec.layer_names
    chunks_of = {g: _chunks(src, dst, src_block_ids, dst_block_ids, num_tokens, g) for g in pairing.groups}
    direct: list[CopyPlan] = []
    parts: list[CopyPlan] = []
    staged: list[StagedLayer] = []
    direct_bytes = expected_direct = staging_used = staged_bytes = 0
    staging_addr, staging_size = staging if staging is not None else (0, 0)
    for group, per_token in pairing.row_bytes.items():
        ch = chunks_of[group]
        expected_direct += ch.count * ch.tokens * per_token
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
            part = _direct(x.src, x.dst, ch, x.heads, x.s_h0, x.d_h0)
            hnd_by_group.setdefault(x.group, []).append(part)
            direct_bytes += part.total_bytes
    direct += [CopyPlan.merge_parallel(p) for p in hnd_by_group.values()]
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
            start = staging_used
            staging_used += n_src * s.block_bytes
            dst_addrs = staging_addr + start + np.arange(n_src, dtype=np.int64) * s.block_bytes
            parts.append(CopyPlan(s.block_addrs(src_ids), dst_addrs, np.full(n_src, s.block_bytes, np.int64)))
            staged_bytes += n_src * s.block_bytes
            sources.append(StagedRegion(s, start, n_src, st.s_h0))
        staged.append(
            StagedLayer(
                layer_name=st.name,
                src_layer=st.src_layer,
                sources=tuple(sources),
                dst_block_ids=np.asarray(dst_block_ids[st.group], dtype=np.int64),
                dst_tokens_per_block=st.d_regions[0].tokens_per_block,
                num_tokens=num_tokens[st.group],
                heads=st.heads,
                dst_head_start=st.d_h0,
            )
        )
    if staging_used > staging_size and staging is not None:
        raise PlanError(f"staging needs {staging_used} B, the buffer given has {staging_size} B; pass a larger one")
    if staging_used and staging is None:
        first = pairing.staged[0]
        raise PlanError(
            f"this transfer must stage {staging_used} B: layouts or TP head slices differ between the sides (layer "
            f"{first.name!r}: source {src.engine_id} rank {src.rank} has {_describe(first.s_regions)}, destination "
            f"{dst.engine_id} rank {dst.rank} has {_describe(first.d_regions)}); pass staging=(addr, nbytes) of a "
            f"registered destination buffer"
        )
    if direct_bytes != expected_direct:
        raise PlanError(f"plan covers {direct_bytes} B directly but the request needs {expected_direct} B")
    every = direct + parts
    if rows_only and len(every) == 1:
        plan = every[0]
    else:
        plan = CopyPlan.concat(every).coalesced() if every else CopyPlan.empty()
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
