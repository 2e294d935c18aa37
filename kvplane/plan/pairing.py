"""How two manifests' regions pair up per layer, worked out once per manifest pair and kept (``pairing``).

A destination region pairs with the source region holding the same slot. A layer whose pairs all line up chunk by
chunk moves directly: token-major (NHD) pairs of a KV-cache group become one ``Rows`` (every pair's descriptors in
one broadcast), head-major (HND) pairs a ``HeadMajor`` each. Any other layer is a ``StagedPair``: whole source blocks
go to a staging buffer and are re-laid out on the destination (``planner``). Only arrays over blocks are built per
request; the pairing depends on the two manifests and the layer list alone, so it is memoised for the last
``PAIRINGS_KEPT`` pairs, under a lock (both sides' threads plan in a ``kv_both`` instance).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplane._native import optional
from kvplane.descriptors import CopyPlan, Region
from kvplane.errors import PlanError, SpecError
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import LayerSpec
from kvplane.plan.heads import head_range, overlap
from kvplane.plan.tokens import Chunks

REPLICATED_FAMILIES = frozenset({"mla", "index"})

_native, _ = optional("_memcpy")  # the C pass the offload planner uses too; numpy where it is not built


def direct_ok(s: Region, d: Region, heads: tuple[int, int]) -> bool:
    if s.parts != d.parts or s.order != d.order or s.row_bytes != d.row_bytes:
        return False
    if s.order == "HND":
        return True
    return heads[1] - heads[0] == s.heads == d.heads  # token-major: only whole token rows are contiguous


def head_major_plan(s: Region, d: Region, ch: Chunks, heads: tuple[int, int], s_h0: int, d_h0: int) -> CopyPlan:
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


class Rows:
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
class HeadMajor:
    """A head-major (HND) direct pair: head runs, built per request with ``head_major_plan``."""

    group: int
    src: Region
    dst: Region
    heads: tuple[int, int]
    s_h0: int
    d_h0: int


@dataclass(frozen=True)
class StagedPair:
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
class Pairing:
    """What a transfer between two manifests does per layer, worked out once: which pairs move directly (token-
    major rows per group, head-major pairs) and which layers are staged. Holds the manifests so that a cached
    pairing is only ever used for the very objects it was built from."""

    src: Manifest
    dst: Manifest
    groups: list[int]  # KV-cache groups the layers use, in first-use order
    rows: dict[int, Rows]
    hnd: list[HeadMajor]
    staged: list[StagedPair]
    row_bytes: dict[int, int]  # per group: direct bytes per chunk token, over every direct pair


_PAIRINGS: OrderedDict[tuple[int, int, tuple[str, ...] | None], Pairing] = OrderedDict()
_PAIRINGS_LOCK = threading.Lock()
PAIRINGS_KEPT = 64


def pairing(src: Manifest, dst: Manifest, layers: Sequence[str] | None) -> Pairing:
    """The pairing of ``src`` and ``dst`` for ``layers`` (all the destination's when None): kept for the very
    manifest objects it was built from (an id reused by a later manifest does not match)."""
    key = (id(src), id(dst), tuple(layers) if layers is not None else None)
    with _PAIRINGS_LOCK:
        hit = _PAIRINGS.get(key)
        if hit is not None and hit.src is src and hit.dst is dst:
            _PAIRINGS.move_to_end(key)
            return hit
    made = _pair_layers(src, dst, list(layers) if layers is not None else dst.spec.layer_names)
    with _PAIRINGS_LOCK:
        _PAIRINGS[key] = made
        while len(_PAIRINGS) > PAIRINGS_KEPT:
            _PAIRINGS.popitem(last=False)
    return made


def _pair_layers(src: Manifest, dst: Manifest, names: list[str]) -> Pairing:
    s_index, d_index = by_layer(src), by_layer(dst)
    d_layers = {layer.name: layer for layer in dst.spec.layers}
    s_layers = {layer.name: layer for layer in src.spec.layers}
    groups: list[int] = []
    row_pairs: dict[int, list[tuple[Region, Region]]] = {}
    hnd: list[HeadMajor] = []
    staged: list[StagedPair] = []
    row_bytes: dict[int, int] = {}
    for name in names:
        d_layer = d_layers[name] if name in d_layers else dst.spec.layer(name)  # the latter raises, naming it
        s_layer = s_layers[name] if name in s_layers else src_layer(src, name)
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
        if len(pairs) == len(d_regions) and all(direct_ok(s, d, heads) for s, d in pairs):
            for s, d in pairs:
                row_bytes[group] = row_bytes.get(group, 0) + (heads[1] - heads[0]) * d.row_bytes
                if s.order == "NHD":
                    row_pairs.setdefault(group, []).append((s, d))
                else:
                    hnd.append(HeadMajor(group, s, d, heads, s_h0, d_h0))
            continue
        staged.append(StagedPair(name, group, s_layer, s_regions, d_regions, heads, s_h0, d_h0))
    rows = {g: Rows(pairs) for g, pairs in row_pairs.items()}
    return Pairing(src, dst, groups, rows, hnd, staged, row_bytes)


def by_layer(manifest: Manifest) -> dict[str, list[Region]]:
    out: dict[str, list[Region]] = {}
    for r in manifest.regions:
        out.setdefault(r.layer_name, []).append(r)
    return out


def describe(regions: list[Region]) -> str:
    """A layer's regions as a person reads them: ``k+v rows of 512 B x 8 heads, NHD``."""
    return "; ".join(f"{r.slot} rows of {r.row_bytes} B x {r.heads} heads, {r.order}" for r in regions)


def src_layer(src: Manifest, name: str) -> LayerSpec:
    try:
        return src.spec.layer(name)
    except SpecError:
        raise PlanError(f"layer {name!r} is not in the source manifest ({src.engine_id} rank {src.rank})") from None
