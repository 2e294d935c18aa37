"""The phases of a request a decode rank receives, and the pure rules that move it between them.

``DecodeSide`` keeps one ``Phase`` per request (``Want.phase``) and asks these functions what an event does;
nothing here does I/O. The rule they enforce is the fence: a request is reported (``get_finished``, so its
blocks go back to the engine) only once nothing can write its blocks: every transfer into them ended in the
engine, or the engine was reset. A request that has a verdict (``failed``, ``timed_out``) before that is
``DRAINING``, counted by ``DecodeSide.draining_requests``; and a transfer's end that comes after the request
was reported (a late ``PushResult``, a READ callback) is never applied to it.

    CONNECT --start--> MOVE --every writer ended--> REPORTED
       |                 |                              ^
       |              verdict                           |
       |                 v                              |
       |             DRAINING --every writer ended, or the engine reset-+
       +--verdict (nothing was submitted)--> REPORTED
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    CONNECT = "connect"  # handshakes with its prefill ranks, staging room; nothing can write its blocks yet
    MOVE = "move"  # READs (pull) or the prefill's WRITEs (push) may be running; no verdict yet
    DRAINING = "draining"  # a verdict is given, and a transfer may still write its blocks
    REPORTED = "reported"  # its Completion is out: the blocks are the engine's


def start(phase: Phase) -> Phase:
    """The transfers were submitted (pull) or the registration sent (push)."""
    return Phase.MOVE if phase is Phase.CONNECT else phase


def after_verdict(phase: Phase, writers: int) -> Phase:
    """A verdict (a failure, a deadline, an abort) while ``writers`` prefill ranks may still write."""
    if phase is Phase.MOVE and writers:
        return Phase.DRAINING
    return phase


def counts(phase: Phase) -> bool:
    """Whether the end of a transfer into the request's blocks still counts for it: not once it was reported."""
    return phase in (Phase.MOVE, Phase.DRAINING, Phase.CONNECT)


def writer_ended(phase: Phase, pending: set[int], rank: int) -> bool:
    """Prefill rank ``rank``'s transfer into the request ended (its READ called back, or its ``PushResult``
    came): True when that counts, and ``rank`` leaves ``pending``; False for a late or repeated end (dropped)."""
    if not counts(phase) or rank not in pending:
        return False
    pending.discard(rank)
    return True


def may_report(phase: Phase, writers: int) -> bool:
    """The fence: report (hand the blocks back) only while unreported and once nothing can write them."""
    return phase is not Phase.REPORTED and writers == 0
