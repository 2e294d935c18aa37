"""What a transfer of either engine keeps while it moves one plan chunk by chunk: the plan's sides, the chunk
in flight, the deadline, the error, and the messages that name them.

``MooncakeTransfer`` (a worker thread) and ``NixlTransfer`` (a state machine advanced by ``poll``) derive from
``ChunkedTransfer``; each transport hands its transfer what the engine calls need, never itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.descriptors import CopyPlan
from kvplane.errors import TransferTimeout, TransportError
from kvplane.transports.base import Op, Transfer, TransportConfig, local_remote
from kvplane.transports.batching import Deadline, batch_size, chunk_bounds


@dataclass(frozen=True)
class Job:
    """One submitted plan: to or from ``peer``, split into ``chunks`` (``(start, stop)`` descriptor ranges),
    ``notify`` delivered after the last, due by ``deadline``."""

    peer: str
    op: Op
    plan: CopyPlan
    chunks: list[tuple[int, int]]
    notify: bytes | None
    deadline: Deadline

    @classmethod
    def split(cls, config: TransportConfig, engine_limit: int, peer: str, op: Op, plan: CopyPlan,
              notify: bytes | None) -> Job:
        """``plan`` in chunks of ``TransportConfig.max_batch`` (at most ``engine_limit``), due in ``timeout_s``."""
        chunks = chunk_bounds(len(plan), batch_size(config, engine_limit))
        return cls(peer, op, plan, chunks, notify, Deadline.after(config.timeout_s))


class ChunkedTransfer(Transfer):
    """A ``Job``'s chunks, moved in order to or from its peer."""

    engine: ClassVar[str]  # the engine's name in messages: "mooncake", "NIXL"

    def __init__(self, config: TransportConfig, job: Job) -> None:
        self._config, self._peer, self._op = config, job.peer, job.op
        self._local, self._remote = local_remote(job.op, job.plan)
        self._length = job.plan.length
        self._chunks, self._notify, self._deadline = job.chunks, job.notify, job.deadline
        self._index = 0  # the chunk in flight
        self._error: TransportError | None = None
        self._unsettled = False  # failed while the engine may still move some of it

    def _limit_s(self, timeout_s: float | None) -> float:
        """How long ``wait(timeout_s)`` may block: the caller's bound, never past the deadline."""
        remaining = self._deadline.remaining()
        return remaining if timeout_s is None else min(timeout_s, remaining)

    def _timed_out(self, limit_s: float) -> TransferTimeout:
        return TransferTimeout(
            f"{self.engine} {self._op} with {self._peer}: not done after {limit_s:.1f} s, chunk {self._index + 1} "
            f"of {len(self._chunks)} in flight; raise TransportConfig.timeout_s or check the peer"
        )

    def _where(self, what: str) -> str:
        """``what`` happened to the chunk in flight, with the peer, the op and the chunk's size."""
        start, stop = self._chunks[min(self._index, len(self._chunks) - 1)]
        nbytes = int(self._length[start:stop].sum())
        return (
            f"{self.engine} {self._op} with {self._peer}: chunk {self._index + 1} of {len(self._chunks)} "
            f"({stop - start} descriptors, {nbytes} B) {what}"
        )
