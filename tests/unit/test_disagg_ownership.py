"""The prefill's rules for whose word counts (``ownership.py``), driven by hypothesis with honest and forged
messages in any order: ``ReadDone``s, push registrations and ``Cancel``s before any registration (a push the
decode could not plan) from the real decode instance (the request's token)
and from an attacker (a guessed token, or the right token too late: another instance owns the request), before
and after the engine hands the request over, repeated at will.

Invariants: the owner is never the attacker; no attacker's read or registration ever counts; every honest
``ReadDone`` and ``Cancel`` counts once the request is handed over, whether it came before or after (none is
dropped), and no attacker's ``Cancel`` declines the request; nothing unchecked is left once the request is handed over.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.flows.disagg.prefill import ownership
from kvplane.flows.disagg.prefill.held_phases import Phase
from kvplane.flows.disagg.prefill.held_record import Held
from kvplane.flows.disagg.prefill.push_target import Target, TargetPhase
from kvplane.flows.disagg.wire.messages import PushRegister
from kvplane.flows.disagg.wire.tokens import new_token

HONEST, ATTACKER = "decode", "evil"
RANKS = st.integers(0, 2)


def registration(engine: str, rank: int, token: str) -> Target:
    reg = PushRegister("r", engine, rank, 3, {0: [1]}, 16, 0, 0, "boot", token)
    return Target(peer=None, register=reg, layers=[])  # type: ignore[arg-type]  # rules never touch the peer


class Ownership(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.token = new_token()
        self.held = Held("r")
        self.honest_reads: dict[int, bool] = {}
        self.honest_registered: set[int] = set()
        self.honest_declined = False

    @rule(rank=RANKS, ok=st.booleans())
    def honest_read_done(self, rank: int, ok: bool) -> None:
        assert ownership.read_done(self.held, (HONEST, rank), ok, 3, self.token)
        self.honest_reads[rank] = ok

    @rule(rank=RANKS, ok=st.booleans(), knows_token=st.booleans())
    def attacker_read_done(self, rank: int, ok: bool, knows_token: bool) -> None:
        if knows_token and not self.held.owner:
            return  # the token is a secret of the honest pair; knowing it, the first to show it owns the request
        token = self.token if knows_token else new_token()
        ownership.read_done(self.held, (ATTACKER, rank), ok, 3, token)

    @rule(rank=RANKS)
    def honest_register(self, rank: int) -> None:
        if ownership.may_register(self.held, HONEST, self.token):
            self.held.targets[(HONEST, rank)] = registration(HONEST, rank, self.token)
            if self.held.known:  # registered after the hand-over: it counts at once, as HeldRequest.register does
                self.held.targets[(HONEST, rank)].phase = TargetPhase.CHECKED
            self.honest_registered.add(rank)

    @rule(rank=RANKS)
    def attacker_register(self, rank: int) -> None:
        token = new_token()
        if ownership.may_register(self.held, ATTACKER, token):
            self.held.targets[(ATTACKER, rank)] = registration(ATTACKER, rank, token)

    @rule(rank=RANKS)
    def honest_decline(self, rank: int) -> None:
        assert ownership.decline(self.held, (HONEST, rank), self.token)
        self.honest_declined = True

    @rule(rank=RANKS, knows_token=st.booleans())
    def attacker_decline(self, rank: int, knows_token: bool) -> None:
        if knows_token and not self.held.owner:
            return  # as for ReadDone: knowing the secret token before the owner showed it is out of scope
        ownership.decline(self.held, (ATTACKER, rank), self.token if knows_token else new_token())

    @rule()
    def hand_over(self) -> None:
        if self.held.known:
            return
        self.held.phase = Phase.COMPUTING  # the machine leaves EARLY, then judges the early word
        refused = ownership.hand_over(self.held, self.token)
        assert all(t.register.engine_id == ATTACKER for t in refused)

    @invariant()
    def the_attacker_never_counts(self) -> None:
        assert self.held.owner in ("", HONEST)
        assert all(engine == HONEST for engine, _ in self.held.readers)
        assert all(t.register.engine_id == HONEST for t in self.held.targets.values() if t.checked)
        assert ATTACKER not in self.held.declined

    @invariant()
    def no_honest_word_is_dropped(self) -> None:
        if not self.held.known:
            return
        assert {r: ok for (_, r), ok in self.held.readers.items()} == self.honest_reads
        assert {r for (_, r), t in self.held.targets.items() if t.checked} == self.honest_registered
        assert not self.held.early_reads and all(t.checked for t in self.held.targets.values())
        assert bool(self.held.declined) == self.honest_declined and not self.held.early_declines


TestOwnership = Ownership.TestCase
TestOwnership.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_the_machine_runs(**_: Any) -> None:
    """A smoke run outside hypothesis' runner, so a broken import shows as one plain failure."""
    machine = Ownership()
    machine.honest_read_done(0, True)
    machine.hand_over()
    machine.no_honest_word_is_dropped()
