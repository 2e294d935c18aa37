"""Reference reads of engine caches by plain torch indexing, independent of kvplane's layout code.

``canonical(layout, value, ids, n, layer)`` gives, per spec slot, the request's first ``n`` tokens as
``(tokens, heads, dim)`` read from blocks ``ids`` of the logical view, whatever the memory order. Tests compare
what kvplane moved against this. A test's layout choice is a layout name with an optional memory order:
``"packed_kv"`` (NHD) or ``"packed_kv@HND"``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplane.kv.spec import LayerSpec


def split_choice(choice: str) -> tuple[str, str]:
    """``"packed_kv@HND"`` -> ``("packed_kv", "HND")``; the order defaults to NHD."""
    name, _, order = choice.partition("@")
    return name, order or "NHD"


def canonical(choice: str, value: object, ids: np.ndarray, n: int, layer: LayerSpec) -> dict[str, torch.Tensor]:
    layout = split_choice(choice)[0]
    idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if layout == "packed_kv":  # logical (nb, heads, bs, 2*head)
        rows = value[idx].permute(0, 2, 1, 3)  # type: ignore[index]
        d = rows.shape[-1] // 2
        rows = rows.reshape(-1, rows.shape[2], 2 * d)[:n]
        return {"k": rows[..., :d], "v": rows[..., d:]}
    if layout in ("kv_first", "split_kv", "block_kv"):
        kv = (value[:, 0], value[:, 1]) if layout == "block_kv" else (value[0], value[1])  # type: ignore[index,call-overload]
        k, v = kv[0][idx], kv[1][idx]
        return {"k": k.reshape(-1, k.shape[2], k.shape[3])[:n], "v": v.reshape(-1, v.shape[2], v.shape[3])[:n]}
    rank, rope = layer.slot("kv_c").head_dim, layer.slot("k_pe").head_dim
    if layout == "mla_fused":
        rows = value[idx].reshape(-1, rank + rope)  # type: ignore[index]
        return {"kv_c": rows[:n, None, :rank], "k_pe": rows[:n, None, rank:]}
    if layout == "mla_split":
        return {"kv_c": value[0][idx].reshape(-1, 1, rank)[:n], "k_pe": value[1][idx].reshape(-1, 1, rope)[:n]}  # type: ignore[index]
    raise ValueError(f"no reference read for layout {layout!r}")


def packed_kv_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM's packed cache (logical ``(nb, heads, bs, 2*dim)``) as ``(nb, bs, heads, dim)`` views:
    ``k[block, offset]`` is one token's heads, and writes go through to the cache."""
    rows = t.permute(0, 2, 1, 3)
    d = rows.shape[-1] // 2
    return rows[..., :d], rows[..., d:]
