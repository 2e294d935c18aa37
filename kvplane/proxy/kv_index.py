"""Where one instance holds which prefix, per tier: the prefix index of ``--policy kv-aware``.

vLLM names a cached block by a chained hash it never exposes (seeded per process unless ``PYTHONHASHSEED`` is
set), so the proxy does not recompute it: it learns it. A ``BlockStored`` that carries ``token_ids`` (vLLM's device
tier always does: ``vllm/v1/core/block_pool.py`` ``cache_full_blocks``) teaches, for each of its blocks,
``(parent hash, the block's token ids) -> hash``; every ``BlockStored`` marks its hashes present in its tier, and a
tier's events without tokens (the CPU tier's ``token_ids=[]``, ``block_size=0``, as vLLM's OffloadingConnector
publishes) mark hashes already learned. ``hit(tokens)`` walks a prompt's full blocks from the root through the
learned map while each block is present in some tier, and says the tier of each.

Both maps are bounded (``max_entries`` each, per tier for presence): at the bound the least recently announced or
used entry goes, which can only make a later walk stop earlier (an expected hit too short, never a block claimed
that was not announced). Blocks whose hash has more inputs than their tokens (a LoRA, ``extra_keys``: multimodal,
``cache_salt``) are marked present but not learned, so a plain prompt never walks into them.

Pure data, no I/O and no lock: the subscriber (``kv_events.py``) and the router (``router.py``) share one under
their lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

Hash = bytes | int  # vLLM's ExternalBlockHash
WIDTH = 8  # bytes per token id in a block's key: the ids as int64, so a key hashes once (bytes cache their hash)


def token_bytes(tokens: Sequence[int] | bytes) -> bytes:
    """A prompt's (or an event's) token ids as the bytes the index keys are cut from; bytes pass as they are."""
    return tokens if isinstance(tokens, bytes) else np.asarray(tokens, dtype=np.int64).tobytes()
DEVICE, CPU, STORE = "device", "cpu", "store"
TIERS = (DEVICE, CPU, STORE)  # in the order a walk prefers them


def tier_of(medium: str | None, locality: str | None = None) -> str:
    """The tier of an event's ``medium``: ``GPU`` (and ``None``, older publishers) is the device, ``CPU`` the
    host; anything else (vLLM's ``STORAGE``, kvplane's ``MOONCAKE``) and anything ``locality="REMOTE"`` (a store
    behind a vLLM secondary tier says ``CPU``) is the store tier, the slowest to load from."""
    if locality == "REMOTE":
        return STORE
    if medium is None or medium == "GPU":
        return DEVICE
    return CPU if medium == "CPU" else STORE


class PrefixIndex:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r}: give the most entries the index keeps, 1 or more")
        self.max_entries = max_entries
        self.children: OrderedDict[tuple[Hash | None, bytes], Hash] = OrderedDict()
        self.present: dict[str, OrderedDict[Hash, None]] = {tier: OrderedDict() for tier in TIERS}
        self.block_size = 0  # tokens per full block: the largest a device event announced
        self.evicted = 0  # entries dropped at the bound, ever

    def stored(self, hashes: Sequence[Hash], parent: Hash | None, token_ids: Sequence[int], block_size: int,
               tier: str, plain: bool = True) -> None:
        """A ``BlockStored``. ``plain``: the hash depends on the tokens alone (no LoRA, no extra keys)."""
        if plain and block_size > 0 and token_ids and len(token_ids) == len(hashes) * block_size:
            if tier == DEVICE:
                self.block_size = max(self.block_size, block_size)
            raw, step = token_bytes(token_ids), block_size * WIDTH
            for i, block_hash in enumerate(hashes):
                key = (parent, raw[i * step:(i + 1) * step])
                self.children[key] = block_hash
                self.children.move_to_end(key)
                parent = block_hash
            self._trim(self.children)
        present = self.present[tier]
        for block_hash in hashes:
            present[block_hash] = None
            present.move_to_end(block_hash)
        self._trim(present)

    def removed(self, hashes: Sequence[Hash], tier: str) -> None:
        present = self.present[tier]
        for block_hash in hashes:
            present.pop(block_hash, None)

    def cleared(self) -> None:
        """``AllBlocksCleared`` (vLLM's prefix-cache reset): nothing is present; what was learned stays true."""
        for present in self.present.values():
            present.clear()

    def reset(self) -> None:
        """Forget everything (the publisher restarted: a new process may hash with a new seed)."""
        self.cleared()
        self.children.clear()
        self.block_size = 0

    def hit(self, tokens: Sequence[int] | bytes) -> list[str]:
        """The tier of each leading block of ``tokens`` (ids, or ``token_bytes`` of them: a router asking several
        indexes converts once) the instance holds. As vLLM, at most the blocks before the prompt's last token: that
        one is always computed."""
        size = self.block_size
        tiers: list[str] = []
        if not size:
            return tiers
        raw, step = token_bytes(tokens), size * WIDTH
        parent: Hash | None = None
        for start in range(0, (len(raw) // WIDTH - 1) // size * step, step):
            key = (parent, raw[start:start + step])
            block_hash = self.children.get(key)
            tier = None if block_hash is None else next((t for t in TIERS if block_hash in self.present[t]), None)
            if block_hash is None or tier is None:
                break
            self.children.move_to_end(key)
            self.present[tier].move_to_end(block_hash)
            tiers.append(tier)
            parent = block_hash
        return tiers

    def _trim(self, entries: OrderedDict[Any, Any]) -> None:
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evicted += 1
