"""Store keys: ``{namespace}/{fingerprint}/g{group}/{prefix hash:016x}``.

The fingerprint hashes everything that decides a host block's bytes: the KV spec, how each host block is laid
out (the device regions' slots, block bytes and in-block order, which follow the engine's layout), and the
rank's TP position. Two instances that serve the same model the same way share keys, so they share prefixes;
anything else gets other keys, so a block is never read back in a shape it was not written in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from kvplane.descriptors import Region
from kvplane.kv.spec import KVSpec


def fingerprint(spec: KVSpec, regions: Sequence[Region], tp_rank: int = 0, tp_size: int = 1) -> str:
    shape = [(r.group_id, r.layer_name, r.parts, r.block_bytes, r.heads, r.row_bytes, r.order) for r in regions]
    blob = msgspec.msgpack.encode({"spec": spec, "blocks": shape, "tp": (tp_rank, tp_size)})
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def block_keys(namespace: str, fp: str, group: int, hashes: Sequence[int]) -> list[str]:
    prefix = f"{namespace}/{fp}/g{group}/"
    return [f"{prefix}{h:016x}" for h in hashes]
