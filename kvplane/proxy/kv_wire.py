"""vLLM's KV-event batches as they come off the wire, read without importing vLLM (the proxy runs without it).

``vllm/distributed/kv_events.py`` (0.27.1 and 0.33.0): the PUB socket sends ``(topic, seq, payload)``: ``seq`` an
8-byte big-endian count from 0, ``payload`` a ``KVEventBatch`` in msgpack: an array ``[ts, events,
data_parallel_rank?]`` (``array_like``, ``omit_defaults``), each event a map tagged ``"type": "<class name>"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; ``tag=True``). The replay ROUTER answers a request
``(b"", start seq)`` with ``(b"", topic, seq, payload)`` per buffered batch from ``start``, then
``(b"", b"", END_SEQ, b"")`` with ``END_SEQ = (-1).to_bytes(8, "big", signed=True)`` (``_service_replay``; a
DEALER receives these without the ROUTER's identity frame).

Only the fields the router reads are declared; the others are ignored, so later vLLMs' additions pass. An event of
a type this file does not know is skipped and counted; a batch that is not a ``KVEventBatch`` is an error.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    locality: str | None = None  # vLLM's secondary tiers: "REMOTE" for a store behind the host
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None

    @property
    def plain(self) -> bool:
        """The hashes depend on the token ids alone (vLLM adds a LoRA's name and ``extra_keys``: multimodal
        inputs, ``cache_salt``, prompt embeddings, when present)."""
        return self.lora_name is None and self.lora_id is None and not any(
            key is not None for key in self.extra_keys or ())


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[bytes | int]
    medium: str | None = None
    locality: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(Batch)
_EVENT = msgspec.msgpack.Decoder(Event)  # a union of tagged structs


class WireError(ValueError):
    pass


def decode(payload: bytes) -> tuple[Batch, list[Event], int]:
    """The batch, its events of known types, and how many it skipped (unknown types)."""
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a vLLM KVEventBatch ({e})") from None
    events: list[Event] = []
    skipped = 0
    for raw in batch.events:
        try:
            events.append(_EVENT.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    return batch, events, skipped


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
