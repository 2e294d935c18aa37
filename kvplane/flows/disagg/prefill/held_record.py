"""The prefill side's record of one request it holds, or has word of from a decode rank before the engine handed it
over (``Held``), with the decode ranks it is pushed to (``push_target.Target``). ``held_request.py`` (with
``ownership.py``) owns its changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.blocks.groups import Ids
from kvplane.flows.disagg.prefill.held_phases import Phase
from kvplane.flows.disagg.prefill.push_target import Target


@dataclass
class Held:
    """One request this prefill rank holds, or has word of from a decode rank before the engine handed it over.

    ``token`` comes from the engine; messages count only with it. ``owner`` is the decode instance (engine id)
    the first message carrying the right token came from: later messages count only from that instance.
    Word that came before the engine handed the request over (``early_reads``, unchecked ``targets``) is
    checked against the token once it is known.
    """

    request_id: str
    block_ids: dict[int, Ids] | None = None
    num_tokens: int = 0
    token: str = ""
    owner: str = ""
    early_reads: dict[tuple[str, int], tuple[bool, int, str]] = field(default_factory=dict)  # ok, tp, token
    phase: Phase = Phase.EARLY  # moved only by HeldRequest, through its transition table
    readers: dict[tuple[str, int], bool] = field(default_factory=dict)
    reader_tp: int = 0
    targets: dict[tuple[str, int], Target] = field(default_factory=dict)
    target_tp: int = 0
    saved: set[str] = field(default_factory=set)
    declined: str = ""  # why a decode rank gave the push up before registering it (its Cancel): release now
    early_declines: dict[tuple[str, int], str] = field(default_factory=dict)  # such Cancels before hand-over: token

    @property
    def known(self) -> bool:
        """The engine handed the request over (``start_request`` or ``request_finished``)."""
        return self.phase is not Phase.EARLY and self.phase is not Phase.DROPPED
