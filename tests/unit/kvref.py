"""Reference reads of engine caches by plain torch indexing, independent of kvplane's layout code.

``canonical(layout, value, ids, n, layer)`` gives, per spec slot, the request's first ``n`` tokens as
``(tokens, heads, dim)`` read from blocks ``ids``. Tests compare what kvplane moved against this.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplane.kv.spec import LayerSpec


def canonical(layout: str, value: object, ids: np.ndarray, n: int, layer: LayerSpec) -> dict[str, torch.Tensor]:
    idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if layout in ("gqa_fused", "split_kv", "hnd"):
        k, v = value[0][idx], value[1][idx]  # type: ignore[index]
        if layout == "hnd":
            k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        return {"k": k.reshape(-1, k.shape[2], k.shape[3])[:n], "v": v.reshape(-1, v.shape[2], v.shape[3])[:n]}
    rank, rope = layer.slot("kv_c").head_dim, layer.slot("k_pe").head_dim
    if layout == "mla_fused":
        rows = value[idx].reshape(-1, rank + rope)  # type: ignore[index]
        return {"kv_c": rows[:n, None, :rank], "k_pe": rows[:n, None, rank:]}
    if layout == "mla_split":
        return {"kv_c": value[0][idx].reshape(-1, 1, rank)[:n], "k_pe": value[1][idx].reshape(-1, 1, rope)[:n]}  # type: ignore[index]
    raise ValueError(f"no reference read for layout {layout!r}")
