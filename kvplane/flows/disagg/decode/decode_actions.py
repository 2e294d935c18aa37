"""What a decode request's machine (``decode_request.DecodeRequest``) asks its shell to do: small frozen records,
carried out by ``DecodeSide`` (on its I/O loop) or by a test's model of the world. None of them is done inside
the machine; each says what, the shell says how (a socket, the ``Starter``, the ``Mover``, ``Published``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvplane.flows.disagg.wire.messages import Cancel, Heartbeat, PushRegister, ReadDone
from kvplane.flows.disagg.wire.results import State

ToPrefill = ReadDone | Cancel | PushRegister | Heartbeat


@dataclass(frozen=True)
class Send:
    """Send ``message`` to prefill rank ``rank`` of the request (``ready_only``: only if its connection is ready
    now; a connection being handshaken again is skipped, unless ``later``: then it goes once a handshake with that
    rank succeeds, as a decline does)."""

    rank: int
    message: ToPrefill
    ready_only: bool = False
    later: bool = False


@dataclass(frozen=True)
class Start:
    """Take staging room, plan, and submit the READs or send the push registrations (``Starter.start``); then
    tell the machine ``started``, ``no_room`` or ``cannot_plan``."""


@dataclass(frozen=True)
class Relayout:
    """Re-lay out the staged layers into the request's blocks (``Starter.relayout``); then ``relaid_out``."""


@dataclass(frozen=True)
class Fence:
    """Reset this rank's transfer engine so that no write of ``ranks`` can land any more; then ``fenced``."""

    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class MarkStale:
    """A READ from prefill rank ``rank`` failed: its engine may have been reset, so handshake again with it
    before the next request (if its connection is ready)."""

    rank: int


@dataclass(frozen=True)
class GiveStaging:
    """Hand the request's staging room back to the arena (exactly once, after the fence)."""


@dataclass(frozen=True)
class Report:
    """The request's one ``Completion``: its blocks are the engine's again."""

    state: State
    reason: str = ""


@dataclass(frozen=True)
class Note:
    """A line for the log (the machine logs nothing itself)."""

    level: int
    text: str


Action = Send | Start | Relayout | Fence | MarkStale | GiveStaging | Report | Note
WARNING, INFO, ERROR = logging.WARNING, logging.INFO, logging.ERROR
