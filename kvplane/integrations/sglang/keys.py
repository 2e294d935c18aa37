"""Store keys of SGLang pages: ``{namespace}/{model}/{shard}/{pool}.{format}/{page hash}/{part}``.

Everything that decides a stored object's bytes is in its key, so a page is never read back in a shape or by a
rank it was not written for:

- ``model``: SGLang's storage model name (``HiCacheStorageConfig.model_name``, which SGLang tags with the host
  pool's own page format when it has one), percent-quoted so a ``/`` in it cannot pose as a separator.
- ``shard``: ``tp{tp_size}-r{tp_rank}`` for a pool whose bytes differ per TP rank (MHA heads, Mamba state);
  ``mla`` for one every rank holds alike (MLA latent KV: written by one rank, read by all, whatever the TP
  size). ``-pp{size}.{rank}`` and ``-cp{size}.{rank}`` follow when pipeline or context parallelism splits the
  layers or the tokens.
- ``pool.format``: the pool's name (``kv``, ``swa``, ``mamba``, ...), its host layout and a digest of the
  layout, the dtype and the bytes of each part of a page, so a ``page_first`` page never meets a
  ``page_first_direct`` reader (same sizes, other byte order) nor a bf16 one an fp16 reader.
- ``part``: the page's n-th buffer in the order the host pool's ``get_page_buffer_meta`` lists them (K then V
  for a ``page_first`` MHA page, K and V of every layer for ``layer_first``).

``namespace`` (``StoreConfig.namespace``) separates deployments that share a master and a model name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True)
class Shard:
    """Which part of a model's KV one SGLang rank holds (from ``HiCacheStorageConfig``)."""

    model: str
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0

    def label(self, replicated: bool) -> str:
        """``tp2-r1``, or ``mla`` for a pool every TP rank holds alike; then PP and CP when they split."""
        label = "mla" if replicated else f"tp{self.tp_size}-r{self.tp_rank}"
        if self.pp_size > 1:
            label += f"-pp{self.pp_size}.{self.pp_rank}"
        if self.cp_size > 1:
            label += f"-cp{self.cp_size}.{self.cp_rank}"
        return label


def pool_format(layout: str, dtype: str, part_bytes: Sequence[int]) -> str:
    """``{layout}-{digest}``: the digest covers the layout, the dtype and each part's bytes."""
    blob = repr((layout, dtype, tuple(int(b) for b in part_bytes))).encode()
    return f"{layout}-{hashlib.blake2b(blob, digest_size=4).hexdigest()}"


def key_prefix(namespace: str, shard: Shard, replicated: bool, pool: str, fmt: str) -> str:
    """Everything of a key before the page hash, ending in ``/``."""
    return f"{namespace}/{quote(shard.model, safe='')}/{shard.label(replicated)}/{pool}.{fmt}/"


def page_keys(prefix: str, hashes: Sequence[str], parts: int) -> list[str]:
    """One key per part of each page, page after page (the order of ``get_page_buffer_meta``)."""
    return [f"{prefix}{h}/{i}" for h in hashes for i in range(parts)]
