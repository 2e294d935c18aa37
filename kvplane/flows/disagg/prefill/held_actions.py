"""What a prefill request's machine (``held_request.HeldRequest``) asks its shell to do: small frozen records,
carried out by ``PrefillSide`` (on its I/O loop) or by a test's model of the world. None of them is done inside
the machine; each says what, the shell says how (a socket, its ``Pusher`` and transfer thread, ``Published``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.flows.disagg.prefill.push_target import Target
from kvplane.flows.disagg.wire.messages import Problem, PushResult
from kvplane.flows.disagg.wire.results import Completion


@dataclass(frozen=True)
class Send:
    """Send ``message`` to the peer connection ``to`` (a ZMQ routing id)."""

    to: bytes
    message: PushResult | Problem


@dataclass(frozen=True, eq=False)
class Prepare:
    """Build the per-layer WRITE plans of ``target`` now (layer-wise push), so saved layers go out at once;
    a planning error comes back as ``plan_failed(target, reason)``."""

    target: Target


@dataclass(frozen=True, eq=False)
class Write:
    """Write ``layers`` of the request to ``target`` (one plan over all of them when ``whole``, else the
    prepared per-layer plans); the shell calls ``write_ended(target, error)`` exactly once afterwards."""

    target: Target
    layers: tuple[str, ...]
    whole: bool


@dataclass(frozen=True)
class Registered:
    """A push registration for the request stands (``PrefillSide.push_registered``)."""


@dataclass(frozen=True)
class Release:
    """The engine may free the request's blocks: report ``completion``."""

    completion: Completion


@dataclass(frozen=True)
class Drop:
    """Forget the request: only word from decode ranks was kept, and it expired (no completion)."""


Action = Send | Prepare | Write | Registered | Release | Drop
