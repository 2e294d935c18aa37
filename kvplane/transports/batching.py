"""What both transfer engines share: early span checks, chunking, deadlines, back-off.

``MooncakeTransport`` and ``NixlTransport`` call these before and while submitting a plan; nothing here
touches an engine. Plan direction follows ``kvplane.transports.base``: ``src`` is where bytes come from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.descriptors import CopyPlan, Int64Array
from kvplane.errors import PlanError, TransportError
from kvplane.transports.base import Op, TransportConfig

OPS: tuple[Op, ...] = ("READ", "WRITE")


def check_op(op: str) -> Op:
    if op not in OPS:
        raise TransportError(f"op={op!r} is not a transfer direction; use 'READ' (pull) or 'WRITE' (push)")
    return "READ" if op == "READ" else "WRITE"


def side_names(op: Op) -> tuple[str, str]:
    """The ``CopyPlan`` field holding the ``(local, remote)`` addresses for ``op``."""
    return ("src", "dst") if op == "WRITE" else ("dst", "src")


def check_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Validate ``(addr, length)`` spans handed to ``register``."""
    out: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        if len(span) != 2:
            raise TransportError(f"spans[{i}]={span!r} is not an (addr, length) pair")
        addr, length = int(span[0]), int(span[1])
        if addr <= 0 or length <= 0:
            raise TransportError(
                f"spans[{i}]=(addr={addr:#x}, length={length}): both must be > 0; "
                f"pass backend.registration_spans(regions) or (tensor.data_ptr(), tensor.nbytes)"
            )
        out.append((addr, length))
    return out


def as_bounds(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(addr, length)`` -> the ``(start, end)`` pairs ``CopyPlan.check_within`` takes."""
    return [(a, a + n) for a, n in spans]


def check_plan(
    op: Op,
    plan: CopyPlan,
    local_spans: Sequence[tuple[int, int]],
    remote_spans: Sequence[tuple[int, int]] | None,
    peer: str,
) -> None:
    """``PlanError`` before anything is submitted when a side leaves registered memory.

    Both sides are always checked: a peer that published no spans (``PeerInfo.spans``, None here) has no
    memory a plan may touch, so a non-empty plan with it is refused rather than sent unchecked.
    """
    if not isinstance(plan, CopyPlan):
        raise PlanError(f"submit() takes a CopyPlan, got {type(plan).__name__}")
    local_side, remote_side = side_names(op)
    checks = [("local", local_side, local_spans), (f"remote ({peer})", remote_side, remote_spans or [])]
    for who, side, spans in checks:
        if not spans and len(plan):
            fix = "call register() before submit()" if who == "local" else "the peer must register memory"
            raise PlanError(f"{op} with {peer}: {who} side has no registered memory; {fix}")
        try:
            plan.check_within(side, as_bounds(spans))
        except PlanError as e:
            hint = "register() it first" if who == "local" else "the peer did not register it"
            raise PlanError(f"{op} with {peer}: {who} side ({side}): {e}; {hint}") from e


def chunk_bounds(count: int, per_chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of at most ``per_chunk`` descriptors covering ``count``."""
    if per_chunk <= 0:
        raise TransportError(f"max_batch={per_chunk} must be > 0 descriptors per engine call, or None")
    starts = range(0, count, per_chunk)
    return [(s, min(s + per_chunk, count)) for s in starts]


def batch_size(config: TransportConfig, engine_limit: int) -> int:
    return config.max_batch if config.max_batch is not None else engine_limit


def backoff_s(config: TransportConfig, attempt: int) -> float:
    """Pause before resubmission number ``attempt + 1``: ``backoff_s * 2**attempt``."""
    return float(config.backoff_s * 2**attempt)


def descriptor_table(addrs: Int64Array, lengths: Int64Array, dev_id: int) -> np.ndarray:
    """An ``N x 3`` uint64 table ``(addr, len, dev_id)``, the shape engines take descriptor lists in."""
    table = np.empty((addrs.size, 3), dtype=np.uint64)
    table[:, 0] = addrs
    table[:, 1] = lengths
    table[:, 2] = dev_id
    return table


@dataclass
class Deadline:
    """A point in ``time.monotonic()``; every wait of a transfer is bounded by one."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        if not seconds > 0:
            raise TransportError(f"timeout_s={seconds} must be > 0 seconds")
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at
