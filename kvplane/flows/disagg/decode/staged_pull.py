"""One pull's staged READs, run chunk by chunk through one bounded staging range.

``Starter`` makes a ``StagedPull`` for a request whose layers must be staged (``staging_chunks`` cut them into
chunks) and hands it the range it took: one or two slots. Each free slot READs the next chunk on the side's
transfer thread (``Mover``); once that READ ended, the chunk is re-laid out into the cache on the side's re-layout
``Executor`` (one thread for the side's life, which also keeps its OpenMP team warm), off the I/O loop, and the
slot takes the next chunk. With two slots, one chunk is READ while the other
is re-laid out. Re-layouts of all requests run one at a time on one thread: two of them may write the same
destination blocks (a decode rank that takes heads from two prefill ranks), and each rewrites whole blocks.

Each prefill rank's transfer ends (``DecodeSide._moved``) once all its parts did: its direct READ, if it has
one, and every one of its chunks READ and re-laid out. A failure or a verdict on the request (an abort, a
deadline) stops new chunks; the range goes back to the arena only once no READ into it and no re-layout from
it is left, before the last rank ends (so before the request can be reported). A chunk whose re-layout the
executor refuses or drops (the side is closing) ends failed, so the request still ends. The pull's state lives on
the loop thread; only ``_relayout`` runs on the re-layout thread.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from functools import partial

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.decode.decode_kit import DecodeKit
from kvplane.flows.disagg.decode.records import Want
from kvplane.flows.disagg.decode.staging_chunks import Chunk
from kvplane.flows.disagg.wire.errors import RelayoutError
from kvplane.plan.relayout import apply_relayout
from kvplane.runtime import ExecutorClosed
from kvplane.runtime.executor import Executor

_CLOSING = "re-layout of staged blocks did not run: the side's re-layout thread is closed (the side is closing)"


class StagedPull:
    def __init__(self, kit: DecodeKit, want: Want, chunks: list[Chunk], offset: int, slots: list[int],
                 slot_bytes: int, direct_ranks: set[int], relayouts: Executor) -> None:
        self.kit, self.want, self.relayouts = kit, want, relayouts
        self.offset, self.slot_bytes = offset, slot_bytes
        self._queue = deque(chunks)
        self._free = list(slots)  # absolute offsets in the staging buffer
        self._busy = 0  # chunks being READ or re-laid out
        self._parts: dict[int, int] = {}  # prefill rank -> its parts not yet ended
        for chunk in chunks:
            self._parts[chunk.rank] = self._parts.get(chunk.rank, 0) + 1
        for rank in direct_ranks:
            self._parts[rank] = self._parts.get(rank, 0) + 1
        self._errors: dict[int, KvplaneError] = {}
        self.staged_bytes = sum(c.nbytes for c in chunks)

    @property
    def ranks(self) -> set[int]:
        return set(self._parts)

    def pump(self) -> None:
        """Give each free slot its next chunk; drop the rest once the request has a verdict or a part failed."""
        if self._errors or self.want.machine.verdict is not None:
            ended = []
            while self._queue:
                ended += self._part_done(self._queue.popleft().rank)
            self._end(ended)
            return
        while self._free and self._queue:
            chunk, slot = self._queue.popleft(), self._free.pop()
            self._busy += 1
            record = self.want.conns[chunk.rank].record
            assert record is not None  # every rank handshook before the request started
            plan = chunk.plan_at(self.kit.local.staging_addr + slot)
            self.kit.mover.put(record.handle, plan, partial(self._read, chunk, slot))

    def direct_ended(self, rank: int, error: KvplaneError | None) -> None:
        """Rank ``rank``'s direct READ ended (on the loop)."""
        if error is not None:
            self._fail(rank, error)
        self._end(self._part_done(rank))
        self.pump()

    def _read(self, chunk: Chunk, slot: int, error: KvplaneError | None) -> None:  # on the loop
        if error is not None:
            self._fail(chunk.rank, error)
            self._chunk_done(chunk, slot)
            return
        try:
            job = self.relayouts.submit(partial(self._relayout, chunk, slot), name="re-layout of a staged chunk")
        except ExecutorClosed:  # the side is closing: the chunk ends failed, it does not wait for a thread gone
            self._relaid(chunk, slot, RelayoutError(_CLOSING))
            return
        job.add_done_callback(partial(self._dropped, chunk, slot))

    def _dropped(self, chunk: Chunk, slot: int, job: Future[None]) -> None:  # on either thread
        """A re-layout the executor dropped unrun at close ends its chunk failed, like one it refused."""
        if job.cancelled():
            self.kit.submit(lambda: self._relaid(chunk, slot, RelayoutError(_CLOSING)))

    def _relayout(self, chunk: Chunk, slot: int) -> None:  # on the re-layout thread
        error: KvplaneError | None = None
        try:
            staging = self.kit.local.staging
            assert staging is not None  # a range was taken from it
            area = staging[slot : slot + self.slot_bytes]
            for staged in chunk.staged:
                layer = self.kit.local.spec.layer(staged.layer_name)
                apply_relayout(staged, area, layer, self.kit.local.layouts[layer.family],
                               self.kit.local.kv_caches[staged.layer_name])
            self.kit.local.backend.synchronize()
        except Exception as e:  # a re-layout that fails leaves the blocks untrustworthy
            error = RelayoutError(f"re-layout of staged blocks failed: {e!r}")
        self.kit.submit(lambda: self._relaid(chunk, slot, error))

    def _relaid(self, chunk: Chunk, slot: int, error: KvplaneError | None) -> None:  # on the loop
        if error is not None:
            self._fail(chunk.rank, error)
        self._chunk_done(chunk, slot)

    def _fail(self, rank: int, error: KvplaneError) -> None:
        """Keep the first error of ``rank``'s parts, but a READ's over a re-layout's: the rank's end then says
        its READ failed, and its connection is handshaken again (a local failure alone does not)."""
        if rank not in self._errors or (isinstance(self._errors[rank], RelayoutError)
                                        and not isinstance(error, RelayoutError)):
            self._errors[rank] = error

    def _chunk_done(self, chunk: Chunk, slot: int) -> None:
        self._busy -= 1
        self._free.append(slot)
        ended = self._part_done(chunk.rank)
        self._end(ended)
        self.pump()

    def _part_done(self, rank: int) -> list[int]:
        self._parts[rank] -= 1
        return [rank] if self._parts[rank] == 0 else []

    def _end(self, ranks: list[int]) -> None:
        """Report ranks whose parts all ended; the range goes back first once nothing uses it any more."""
        if not self._queue and not self._busy and self.offset >= 0:
            self.kit.local.arena.give(self.offset)
            self.offset = -1
        for rank in ranks:
            self.kit.moved(self.want, rank, self._errors.get(rank))
