"""The kv-aware prefix index against a brute-force model, fed vLLM's own event classes through the wire.

Random streams of vLLM ``BlockStored`` (device tier with tokens and parent; CPU and store tiers without, as the
OffloadingConnector publishes), ``BlockRemoved`` and ``AllBlocksCleared``, in any order, with duplicates, removals
of blocks never stored and blocks of other KV-cache groups, are encoded as vLLM's publisher encodes a
``KVEventBatch`` (msgspec msgpack), read back by ``kv_wire.decode`` and applied by ``kv_events.apply``. The model
keeps every fact unbounded; below the bound the index answers exactly as the model, at the bound it may stop a
walk early or see a block in a slower tier that also holds it, never claim a block the model does not hold.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvplane.proxy import kv_wire
from kvplane.proxy.kv_events import apply
from kvplane.proxy.kv_index import CPU, DEVICE, STORE, TIERS, PrefixIndex

BLOCK = 2
MEDIUM = {DEVICE: "GPU", CPU: "CPU", STORE: "STORAGE"}
ENCODE = msgspec.msgpack.Encoder()  # as ZmqEventPublisher._publisher_thread encodes a batch


def chain(tokens: list[int], as_int: bool) -> list[bytes | int]:
    """Stand-in for vLLM's hash of each full block: chained, and only the publisher knows it."""
    hashes: list[bytes | int] = []
    parent: bytes | int | None = None
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        digest = hashlib.sha256(repr((parent, tokens[start:start + BLOCK])).encode()).digest()[:8]
        parent = int.from_bytes(digest, "big") if as_int else digest
        hashes.append(parent)
    return hashes


prompts = st.lists(st.integers(0, 2), max_size=9)


@st.composite
def vllm_events(draw: Any) -> list[Any]:
    events: list[Any] = []
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "again", "other_group"]))
        tokens, tier = draw(prompts), draw(st.sampled_from(TIERS))
        hashes = chain(tokens, as_int=False)
        first = draw(st.integers(0, len(hashes))) if hashes else 0
        if kind == "again" and events:
            events.append(events[draw(st.integers(0, len(events) - 1))])  # a duplicate
        elif kind == "clear":
            events.append(AllBlocksCleared())
        elif kind == "remove":
            gone = hashes[first:first + 1] or [b"never-stored"]
            events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM[tier]))
        elif hashes[first:]:
            device = tier == DEVICE
            events.append(BlockStored(
                block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first and device else None,
                token_ids=tokens[first * BLOCK:len(hashes) * BLOCK] if device else [],
                block_size=BLOCK if device else 0, lora_id=None, medium=MEDIUM[tier], lora_name=None,
                group_idx=1 if kind == "other_group" else 0))
    return events


class Model:
    """Every fact of the stream, unbounded: the plain set semantics the index approximates."""

    def __init__(self) -> None:
        self.learned: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self.present: dict[str, set[Any]] = {tier: set() for tier in TIERS}
        self.block_size = 0

    def take(self, event: Any) -> None:
        if isinstance(event, AllBlocksCleared):
            self.present = {tier: set() for tier in TIERS}
        elif event.group_idx not in (None, 0):
            return
        elif isinstance(event, BlockRemoved):
            self.present[_tier(event.medium)] -= set(event.block_hashes)
        else:
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                if event.token_ids:
                    self.learned[(parent, tuple(event.token_ids[i * BLOCK:(i + 1) * BLOCK]))] = h
                    self.block_size = BLOCK
                parent = h
            self.present[_tier(event.medium)] |= set(event.block_hashes)

    def holders(self, tokens: list[int]) -> list[set[str]]:
        """For each leading block the model holds, the tiers holding it."""
        out: list[set[str]] = []
        parent = None
        for start in range(0, (len(tokens) - 1) // BLOCK * BLOCK, BLOCK):
            h = self.learned.get((parent, tuple(tokens[start:start + BLOCK])))
            tiers = {t for t in TIERS if h is not None and h in self.present[t]}
            if not tiers:
                break
            out.append(tiers)
            parent = h
        return out


def _tier(medium: str) -> str:
    return next(t for t, m in MEDIUM.items() if m == medium)


def feed(index: PrefixIndex, events: list[Any], batch_size: int) -> None:
    for start in range(0, len(events), batch_size):
        payload = ENCODE.encode(KVEventBatch(ts=1.0, events=events[start:start + batch_size]))
        _, decoded, skipped = kv_wire.decode(payload)
        assert skipped == 0
        apply(index, decoded)


@settings(max_examples=300, deadline=None)
@given(vllm_events(), st.lists(prompts, min_size=1, max_size=6), st.integers(1, 4))
def test_below_its_bound_the_index_answers_as_the_model(events: list[Any], queries: list[list[int]],
                                                        batch_size: int) -> None:
    index, model = PrefixIndex(10_000), Model()
    feed(index, events, batch_size)
    for event in events:
        model.take(event)
    assert index.block_size == model.block_size
    for tokens in queries:
        holders = model.holders(tokens)
        assert index.hit(tokens) == [next(t for t in TIERS if t in tiers) for tiers in holders]


@settings(max_examples=300, deadline=None)
@given(vllm_events(), st.lists(prompts, min_size=1, max_size=6), st.integers(1, 3))
def test_at_its_bound_the_index_never_claims_a_block_the_model_does_not_hold(
        events: list[Any], queries: list[list[int]], bound: int) -> None:
    index, model = PrefixIndex(bound), Model()
    feed(index, events, 3)
    for event in events:
        model.take(event)
    assert len(index.children) <= bound and all(len(p) <= bound for p in index.present.values())
    for tokens in queries:
        holders, hit = model.holders(tokens), index.hit(tokens)
        assert len(hit) <= len(holders)
        assert all(tier in tiers for tier, tiers in zip(hit, holders))


def test_a_cpu_event_marks_a_learned_block_and_the_walk_prefers_the_device() -> None:
    tokens = [1, 2, 1, 2, 0]
    h1, h2 = chain(tokens, as_int=True)
    index = PrefixIndex(100)
    feed(index, [BlockStored(block_hashes=[h1, h2], parent_block_hash=None, token_ids=tokens[:4], block_size=BLOCK,
                             lora_id=None, medium="GPU", lora_name=None),
                 BlockRemoved(block_hashes=[h2], medium="GPU"),
                 BlockStored(block_hashes=[h2], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                             medium="CPU", lora_name=None)], 3)
    assert index.hit(tokens) == [DEVICE, CPU]
    assert index.hit(tokens[:4]) == [DEVICE]  # vLLM always computes the prompt's last token


def test_a_salted_or_lora_block_is_present_but_never_walked_into() -> None:
    tokens = [1, 1, 0]
    (h,) = chain(tokens[:2], as_int=False)
    index = PrefixIndex(100)
    feed(index, [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens[:2], block_size=BLOCK,
                             lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",)])], 1)
    assert index.hit(tokens) == [] and h in index.present[DEVICE]


def test_events_of_a_type_the_proxy_does_not_know_are_skipped_and_counted() -> None:
    payload = ENCODE.encode([1.0, [{"type": "BlockPinned", "block_hashes": [1]}, {"type": "AllBlocksCleared"}]])
    _, events, skipped = kv_wire.decode(payload)
    assert skipped == 1 and len(events) == 1


def test_kvplanes_store_tiers_count_as_the_store_whatever_their_medium() -> None:
    """kvplane's connector names the store tier's medium ``MOONCAKE``; its vLLM secondary tier says ``CPU`` with
    ``locality="REMOTE"`` (vLLM's medium enum has no store of its own). Both are the store tier, not the host."""
    tokens = [1, 2, 3, 4, 5]
    hashes = chain(tokens, as_int=False)
    events = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:4], block_size=BLOCK,
                          lora_id=None, lora_name=None, medium="GPU"),
              BlockRemoved(block_hashes=hashes, medium="GPU"),
              BlockStored(block_hashes=hashes[:1], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None, lora_name=None,
                          medium="MOONCAKE"),
              BlockStored(block_hashes=hashes[1:], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None, lora_name=None,
                          medium="CPU", locality="REMOTE")]
    index = PrefixIndex(100)
    _, decoded, skipped = kv_wire.decode(ENCODE.encode(KVEventBatch(ts=0.0, events=events)))
    apply(index, decoded)
    assert not skipped and index.hit(tokens) == [STORE, STORE]
