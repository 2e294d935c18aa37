"""Whose word counts for a request a prefill rank holds: the rules, as pure functions of its ``Held`` record.

A message about a request counts only with the request's token and only from the decode instance (engine id)
that first showed it, the owner. Word that arrives before the engine handed the request over (a fast decode's
``ReadDone``, an early push registration) is kept unchecked and judged by ``hand_over`` once the token is known.
No I/O here: the prefill shell sends the replies these functions ask for, and the stateful property test
(``tests/unit/test_disagg_ownership.py``) drives them with honest and forged messages in any order.
"""

from __future__ import annotations

from kvplane.flows.disagg.prefill.held_record import Held
from kvplane.flows.disagg.prefill.push_target import Target, TargetPhase
from kvplane.flows.disagg.wire.tokens import same_token

Key = tuple[str, int]  # (decode engine id, decode rank)


def owned(held: Held, engine_id: str, token: str) -> bool:
    """``token`` is the request's and ``engine_id`` its owner (the first to show the token becomes it)."""
    if not held.known or not same_token(held.token, token) or held.owner not in ("", engine_id):
        return False
    held.owner = engine_id
    return True


def hand_over(held: Held, token: str) -> list[Target]:
    """The engine handed the request over under ``token`` (its machine left ``EARLY``): judge the word that came
    before. Returns the push registrations refused (their senders are told)."""
    held.token = token
    for (engine, rank), (ok, tp, said) in held.early_reads.items():
        if owned(held, engine, said):
            held.readers[(engine, rank)], held.reader_tp = ok, tp
    held.early_reads.clear()
    refused = []
    for key, target in list(held.targets.items()):
        if target.checked:
            continue
        if owned(held, key[0], target.register.token):
            target.to(TargetPhase.CHECKED)
            held.target_tp = target.register.tp_size
        else:
            del held.targets[key]
            refused.append(target)
    for key, said in held.early_declines.items():  # after the registrations: those claim ownership first
        decline(held, key, said)
    held.early_declines.clear()
    return refused


def read_done(held: Held, key: Key, ok: bool, tp_size: int, token: str) -> bool:
    """A decode rank finished reading; False when it does not count (the sender is told)."""
    if not held.known:
        held.early_reads[key] = (ok, tp_size, token)
        return True
    if not owned(held, key[0], token):
        return False
    held.reader_tp = tp_size
    held.readers[key] = ok
    return True


def may_register(held: Held, engine_id: str, token: str) -> bool:
    """Whether a push registration may stand (unchecked until the request is handed over)."""
    return not held.known or owned(held, engine_id, token)


def decline(held: Held, key: Key, token: str) -> bool:
    """A decode rank gave the request up before receiving it (it could not plan a push, or it declined a request
    its engine dropped unscheduled); False when that does not count (the sender is told)."""
    if not held.known:
        held.early_declines[key] = token
        return True
    if not owned(held, key[0], token):
        return False
    held.declined = held.declined or (f"decode {key[0]!r} rank {key[1]} gave the request up before receiving it "
                                      f"(it could not plan it, or its engine dropped it unscheduled; its log says)")
    return True
