"""Between the host tier and the store tier: write-through, write-back on eviction, and fetch on a host miss.

Host blocks under a store call stay referenced in the host index until that call's future completes, even
when the caller stopped waiting for it (a store that went away): a late transfer never reads or writes a block
that was handed to someone else. Puts are asynchronous and released by ``poll``; a write-back on eviction and
a fetch wait, bounded by the store tier, because the block is about to be reused or loaded.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError
from kvplane.flows.offload.host_pool import HostPool
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.keys import block_keys
from kvplane.flows.offload.listener import TierListener
from kvplane.flows.offload.store import OBJECT_NOT_FOUND, StoreTier, StoreWrite


def check_fits(config: StoreConfig, block_bytes: dict[int, int]) -> None:
    """Raise when this client's segment cannot hold one block of every KV-cache group: each host block is one
    store object, and a request is only ever loaded with a block of each group, so every put would be refused
    (-200) and nothing would ever load from the store. A segment of 0 lends nothing (other clients' segments
    hold the objects): not checked."""
    need = sum(block_bytes.values())
    if 0 < config.segment_bytes < need:
        sizes = ", ".join(f"group {g}: {n} B" for g, n in sorted(block_bytes.items()))
        raise OffloadConfigError(
            f"StoreConfig.segment_bytes={config.segment_bytes} cannot hold one block of each KV-cache group "
            f"({need} B; {sizes}): every block would be refused by the store; give segment_bytes many times "
            f"{need} (it holds blocks of every request), or 0 to use only the segments other clients lend"
        )


class StoreLink:
    def __init__(self, tier: StoreTier, index: HostIndex, pool: HostPool, fingerprint: str) -> None:
        self.tier, self.index, self.pool, self.fingerprint = tier, index, pool, fingerprint
        self.write_through = tier.config.write_through
        self._writes: list[StoreWrite] = []
        self._late_gets: list[tuple[Future[list[int]], int, Ids]] = []
        self.listener: TierListener | None = None  # told which puts succeeded and which gets found nothing
        for buf in pool.buffers.values():
            tier.register(int(buf.data_ptr()), int(buf.numel()))

    def keys(self, group: int, hashes: list[int]) -> list[str]:
        return block_keys(self.tier.config.namespace, self.fingerprint, group, hashes)

    def addrs(self, group: int, ids: Ids) -> tuple[list[int], list[int]]:
        """Start address and size of each host block ``ids`` of ``group`` (one store object each)."""
        size = self.pool.block_bytes[group]
        base = int(self.pool.buffers[group].data_ptr())
        return (base + ids * size).tolist(), [size] * len(ids)

    # -- host -> store ------------------------------------------------------------------------------------
    def count_prefix(self, group: int, hashes: list[int]) -> int:
        return self.tier.count_prefix(self.keys(group, hashes))

    def exists(self, group: int, hashes: list[int]) -> list[bool] | None:
        """Which blocks the store holds (one call, any thread: it touches the store only); None when it is down."""
        return self.tier.exists(self.keys(group, hashes))

    def write(self, group: int, ids: Ids, hashes: list[int]) -> None:
        """Put host blocks the caller holds a reference on; that reference goes with the put, released by poll."""
        addrs, sizes = self.addrs(group, ids)
        future = self.tier.put(self.keys(group, hashes), addrs, sizes)
        if future is None:
            self.index.release(group, ids)
            return
        nbytes = sum(sizes)
        self._writes.append(StoreWrite(future, self.tier.put_deadline(nbytes), group, ids, nbytes))

    def before_evict(self, group: int, victims: Ids, hashes: Ids) -> None:
        """Write back cached blocks the host tier is about to evict (write-through already put them)."""
        if self.write_through or not len(victims):
            return
        ids = np.asarray(victims, dtype=np.int64)
        addrs, sizes = self.addrs(group, ids)
        future = self.tier.put(self.keys(group, np.asarray(hashes).tolist()), addrs, sizes)
        if future is None:
            return
        write = StoreWrite(future, self.tier.put_deadline(sum(sizes)), group, ids, sum(sizes))
        try:  # its own bound at most: puts queued before it do not hold up the allocation any longer
            future.result(max(0.0, min(write.deadline - time.monotonic(), self.tier.bound(sum(sizes)))))
        except Exception:  # past its bound or failed: check_put degrades; the victims wait for the put
            pass
        if not self.tier.check_put(write):
            self.index.ref(group, ids)  # still being read by the put: not evictable until it is done
            self._writes.append(write)
        else:
            self._tell_written(write)

    # -- store -> host ------------------------------------------------------------------------------------
    def fetch(self, group: int, hashes: list[int]) -> Ids:
        """Bring the leading ``hashes`` the store holds into host blocks: referenced, keyed, in order."""
        if not hashes or not self.tier.up:
            return np.zeros(0, dtype=np.int64)
        ids = self.index.allocate(group, len(hashes), self.before_evict)
        addrs, sizes = self.addrs(group, ids)
        ok, future = self.tier.get(self.keys(group, hashes[: len(ids)]), addrs, sizes)
        got = len(ok) if all(ok) else ok.index(False)
        if self.listener is not None and got < len(ok) and future is not None and future.done() \
                and future.exception() is None:  # what the store answered it does not hold is gone from it
            if missing := [h for h, rc in zip(hashes, future.result()) if rc == OBJECT_NOT_FOUND]:
                self.listener.store_missing(group, missing)
        self.index.cache(group, ids[:got], hashes[:got])
        rest = ids[got:]
        if future is not None and not future.done():
            self._late_gets.append((future, group, rest))  # a timed-out get may still write into them
        else:
            self.index.release(group, rest)
        return ids[:got]

    # -- completion ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Release the blocks of every store call that has completed."""
        still: list[StoreWrite] = []
        for write in self._writes:
            if self.tier.check_put(write):
                self._tell_written(write)
                self.index.release(write.group, write.host_ids)
            else:
                still.append(write)
        self._writes = still
        late: list[tuple[Future[list[int]], int, Ids]] = []
        for future, group, ids in self._late_gets:
            if future.done():
                self.index.release(group, ids)
            else:
                late.append((future, group, ids))
        self._late_gets = late

    def _tell_written(self, write: StoreWrite) -> None:
        """The listener hears of the blocks a completed put stored (answered 0), while they are still held."""
        if self.listener is None or write.future.exception() is not None:
            return
        ok = np.asarray(write.future.result(), dtype=np.int64) == 0
        if ok.any():
            self.listener.store_written(write.group, np.asarray(write.host_ids, dtype=np.int64)[ok])

    @property
    def in_flight(self) -> int:
        return len(self._writes) + len(self._late_gets)

    def futures(self) -> list[Future[Any]]:
        return [w.future for w in self._writes] + [f for f, _, _ in self._late_gets]
