"""One decode rank a prefill rank pushes a request to (``Target``) and its phases: an Enum with an enforced
transition table, as ``decode_request.py`` is the house model.

``HeldRequest`` (``held_request.py``) and ``ownership.py`` move a target from phase to phase (``to``); the shell's
``Pusher`` reads its registration and keeps its plans. What is not a phase is data: ``error`` (why it fails, the
first cause kept), and how far writing got (``sent`` layers, ``inflight`` writes). docs/disagg.md carries the
table (``transitions_table(TRANSITIONS)``), and a unit test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvplane.descriptors import CopyPlan
from kvplane.flows.disagg.wire.messages import PushRegister
from kvplane.flows.disagg.wire.peers import PeerRecord


class TargetPhase(Enum):
    UNCHECKED = "unchecked"  # registered before the engine handed the request over: its token is not judged yet
    CHECKED = "checked"  # its token matched the request's: written whole once the request finishes
    STREAMING = "streaming"  # its per-layer plans were asked for: layers go out as they are saved
    REPORTED = "reported"  # its PushResult went out: nothing more is written to it or said to it


_ENDS = "its writes ended and the request finished, or it failed, or the request was aborted or declined"
TRANSITIONS: tuple[tuple[TargetPhase, str, TargetPhase], ...] = (
    (TargetPhase.UNCHECKED, "the engine hands the request over under the registration's token",
     TargetPhase.CHECKED),
    (TargetPhase.UNCHECKED, "the wait for the engine to hand the request over ends", TargetPhase.REPORTED),
    (TargetPhase.CHECKED, "the request computes layer by layer, or the push stages: per-layer plans are asked for",
     TargetPhase.STREAMING),
    (TargetPhase.CHECKED, f"{_ENDS}, or the lease expired", TargetPhase.REPORTED),
    (TargetPhase.STREAMING, f"{_ENDS}, or the lease expired", TargetPhase.REPORTED),
)
_ALLOWED = {(a, b) for a, _, b in TRANSITIONS}


@dataclass
class Target:
    """One decode rank a push goes to: its registration, the layers this rank owes it, its phase, how far
    writing got."""

    peer: PeerRecord
    register: PushRegister
    layers: list[str]
    phase: TargetPhase = TargetPhase.UNCHECKED
    plans: dict[str, CopyPlan] | None = None  # its per-layer plans, built by the shell's Pusher (never read here)
    sent: set[str] = field(default_factory=set)
    inflight: int = 0
    error: str = ""

    def to(self, phase: TargetPhase) -> None:
        if (self.phase, phase) not in _ALLOWED:  # a bug in the machine; the transition table is the contract
            raise RuntimeError(f"push target: {self.phase.name} -> {phase.name} is not in TRANSITIONS")
        self.phase = phase

    @property
    def checked(self) -> bool:
        """Its token matched the request's (it counts)."""
        return self.phase is not TargetPhase.UNCHECKED

    @property
    def reported(self) -> bool:
        return self.phase is TargetPhase.REPORTED
