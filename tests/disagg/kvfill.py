"""Seeded byte patterns in an engine cache, and digests of a request's blocks, for the P/D byte checks.

Every int64 word of the cache gets a value derived from its position and the seed, so a misplaced block never
matches. ``digest`` hashes a request's tokens in every slot, in spec order, to compare two caches of the same layout;
``mark`` and ``unmarked`` fill a request's blocks with a marker and count the block slots written since.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch
from kvref import split_choice

from kvplane.kv.binding import token_rows
from kvplane.kv.layouts import LayerValue, get_layout
from kvplane.kv.spec import KVSpec


def tensors_of(cache: Mapping[str, LayerValue]) -> list[torch.Tensor]:
    return [t for v in cache.values() for t in ((v,) if isinstance(v, torch.Tensor) else v)]


def fill(cache: Mapping[str, LayerValue], seed: int) -> None:
    offset = 0
    for t in tensors_of(cache):
        memory = t.permute(*sorted(range(t.dim()), key=lambda d: -t.stride(d)))  # vLLM hands a permuted view
        assert memory.is_contiguous(), f"a cache tensor of strides {t.stride()} is not dense"
        words = memory.view(-1).view(torch.uint8).view(torch.int64)
        torch.arange(offset, offset + words.numel(), dtype=torch.int64, out=words)
        words.mul_(0x9E3779B1).add_(seed << 40)
        offset += words.numel()


def zero(cache: Mapping[str, LayerValue]) -> None:
    for t in tensors_of(cache):
        t.zero_()


def mark(spec: KVSpec, cache: Mapping[str, LayerValue], layout: str, table: Mapping[int, list[int]],
         value: float) -> None:
    """Fill every slot of the blocks in ``table`` with ``value``: what a request's blocks hold once the engine took
    them back, so a write after that shows (``unmarked``)."""
    lay = get_layout(split_choice(layout)[0])
    for layer in spec.layers:
        ids = torch.as_tensor(np.asarray(table[layer.group_id], dtype=np.int64))
        for st in lay.slot_tensors(layer, spec.group(layer.group_id).tokens_per_block, cache[layer.name]):
            st.tensor.index_fill_(0, ids, value)


def unmarked(spec: KVSpec, cache: Mapping[str, LayerValue], layout: str, table: Mapping[int, list[int]],
             value: float) -> tuple[int, int]:
    """``(changed, total)``: block slots (one block of one slot of one layer) no longer all ``value``."""
    lay = get_layout(split_choice(layout)[0])
    changed = total = 0
    for layer in spec.layers:
        ids = torch.as_tensor(np.asarray(table[layer.group_id], dtype=np.int64))
        for st in lay.slot_tensors(layer, spec.group(layer.group_id).tokens_per_block, cache[layer.name]):
            rows = st.tensor.index_select(0, ids).reshape(len(ids), -1)
            changed += int((rows != value).any(dim=1).sum())
            total += len(ids)
    return changed, total


def digest(
    spec: KVSpec, cache: Mapping[str, LayerValue], layout: str, table: Mapping[int, list[int]], tokens: int
) -> str:
    """A hash of the request's first ``tokens`` tokens (``table``: block ids per group) of every slot of every
    layer, slot by slot in spec order, each as ``(tokens, heads, dim)`` (``token_rows``): equal for the same KV
    whatever the layout and block size (K and V packed in one row or apart, fused or split MLA)."""
    h = hashlib.blake2b(digest_size=16)
    for rows in token_rows(spec, cache, split_choice(layout)[0], table, tokens).values():
        h.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
