"""vLLM's KV events for kvplane's tiers: the per-version shim that builds them, and the container they travel in.

The worker half records what its tiers did (``tier_events.TierEvents``); vLLM's model runner takes them each
step through ``get_kv_connector_kv_cache_events`` as a ``KVPlaneKVEvents``, its executor concatenates the
workers' containers (``KVOutputAggregator.aggregate``) and the scheduler half counts them in
(``event_inbox.EventInbox``) until every worker reported one, then hands them to vLLM's scheduler in
``take_events``, which publishes them with its own (``BlockPool``'s) events.

The events follow vLLM's own OffloadingConnector for a tier that holds blocks without their tokens:
``BlockStored(token_ids=[], block_size=0, parent_block_hash=None, medium=..., group_idx=...)``. Hashes are what
vLLM's device tier publishes for the same block (``maybe_convert_block_hash`` of the block's hash, which follows
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). The host tier is ``medium="CPU"``; the store tier names its store,
``medium="MOONCAKE"`` (the field is free text in every supported version) with ``locality="REMOTE"`` (its objects
are host memory pooled across the cluster, as the ``vllm_tier`` events say too), and where vLLM has ``ownership``
("secondary offloading tier identifier", 0.33) it says ``"kvplane"``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

HOST_MEDIUM = MEDIUM_CPU
STORE_MEDIUM = "MOONCAKE"
OWNER = "kvplane"  # vLLM 0.33's ``ownership`` of a secondary tier's events
_STORED_FIELDS = frozenset(BlockStored.__struct_fields__)
_REMOVED_FIELDS = frozenset(BlockRemoved.__struct_fields__)

__all__ = ["HOST_MEDIUM", "STORE_MEDIUM", "KVPlaneKVEvents", "block_removed", "block_stored", "event_hash"]


def event_hash(block_hash: bytes) -> Any:
    """The hash vLLM's events carry for a block whose (bytes) hash is ``block_hash`` (an int by default)."""
    return maybe_convert_block_hash(block_hash)


def _owner(medium: str) -> dict[str, Any]:
    return {"ownership": OWNER, "locality": "REMOTE"} if medium != HOST_MEDIUM else {}


def block_stored(hashes: list[Any], medium: str, group: int) -> KVCacheEvent:
    """vLLM's ``BlockStored`` for blocks a tier can load on their own, with the fields this vLLM has."""
    fields = {"block_hashes": hashes, "parent_block_hash": None, "token_ids": [], "block_size": 0, "lora_id": None,
              "medium": medium, "lora_name": None, "group_idx": group, **_owner(medium)}
    return BlockStored(**{k: v for k, v in fields.items() if k in _STORED_FIELDS})


def block_removed(hashes: list[Any], medium: str, group: int) -> KVCacheEvent:
    fields = {"block_hashes": hashes, "medium": medium, "group_idx": group, **_owner(medium)}
    return BlockRemoved(**{k: v for k, v in fields.items() if k in _REMOVED_FIELDS})


class KVPlaneKVEvents(KVConnectorKVEvents):
    """One worker's events of one step (``num_workers`` 1), or the concatenation vLLM's executor makes of every
    worker's: ``get_all_events`` lists each worker's copy, which the scheduler half counts."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events = list(events or ())
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVPlaneKVEvents:
        return self  # the scheduler half counts the copies, across steps (``event_inbox``)

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1

    def __repr__(self) -> str:
        return f"<KVPlaneKVEvents workers={self._workers} events={len(self._events)}>"
