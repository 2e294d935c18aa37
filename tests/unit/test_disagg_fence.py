"""The fence of a decode request, example by example on its machine (``decode_request.DecodeRequest``): a verdict
while a writer is out drains instead of reporting, a push's drain bound asks for the engine reset, word that comes
after the report is dropped; and docs/disagg.md's transition table is the machine's own. The hypothesis machine
over many requests and a lossy channel is ``test_decode_machine.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvplane.flows.disagg.decode.decode_actions import (
    Action,
    Fence,
    GiveStaging,
    MarkStale,
    Note,
    Relayout,
    Report,
    Send,
    Start,
)
from kvplane.flows.disagg.decode.decode_request import (
    TRANSITIONS,
    DecodeRequest,
    Ident,
    Phase,
    RankView,
    transitions_table,
)
from kvplane.flows.disagg.wire.messages import Cancel, ReadDone

DOCS = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"


def _machine(mode: str, ranks: int = 2) -> DecodeRequest:
    m = DecodeRequest(Ident("r", "pull" if mode == "pull" else "push", "p-r", "prefill", "boot", "tok", ranks,
                            "decode", 0, 1, 2.0), deadline=10.0)
    views = {r: RankView("ready", f"h:{r}", "", "prefill", "boot") for r in range(ranks)}
    assert m.connections(views) == [Start()]
    assert m.started(range(ranks)) == []
    return m


def _kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_pull_reports_done_only_after_every_read_ended_and_was_re_laid_out() -> None:
    m = _machine("pull")
    assert m.transfer_ended(0) == []
    assert m.phase is Phase.MOVE
    assert m.transfer_ended(1) == [Relayout()]
    out = m.relaid_out()
    assert _kinds(out) == ["Send", "Send", "GiveStaging", "Report"]
    assert all(isinstance(a, Send) and isinstance(a.message, ReadDone) and a.message.ok for a in out[:2])
    assert out[-1] == Report("done")


def test_an_abort_during_a_read_drains_until_the_read_ended_then_reports_failed() -> None:
    m = _machine("pull")
    assert m.transfer_ended(0) == []
    assert m.abort() == []
    assert m.phase is Phase.DRAINING
    out = m.transfer_ended(1)
    assert out[-2:] == [GiveStaging(), Report("failed", "aborted on the decode instance")]
    late = m.transfer_ended(1)  # a repeated callback after the report: dropped, with a note
    assert len(late) == 1 and isinstance(late[0], Note) and "after the request was reported" in late[0].text


def test_a_push_past_its_deadline_cancels_and_fences_at_the_drain_bound_then_reports() -> None:
    m = _machine("push")
    assert m.push_result(0, True) == []
    out = m.tick(10.5)
    assert out == [Send(1, Cancel("p-r", "decode", 0, "tok"))]
    assert m.phase is Phase.DRAINING
    assert m.tick(11.0) == []  # the drain bound starts on the first tick that sees it draining
    assert m.tick(12.9) == []
    fence = m.tick(13.1)
    assert len(fence) == 1 and isinstance(fence[0], Fence) and fence[0].ranks == (1,)
    assert m.tick(14.0) == []  # asked once
    assert m.fenced()[-1] == Report("timed_out", "the KV did not arrive before the deadline")
    late = m.push_result(1, True)
    assert len(late) == 1 and isinstance(late[0], Note) and late[0].text.endswith("after it was reported; dropped")


def test_a_failed_push_from_one_rank_waits_for_the_other_and_is_never_done() -> None:
    m = _machine("push")
    assert m.push_result(0, False, "boom") == []
    assert m.phase is Phase.DRAINING
    assert m.push_result(1, True)[-1] == Report("failed", "push from prefill rank 0 failed: boom")


def test_a_handshake_that_failed_reports_at_once_and_tells_every_prefill_rank() -> None:
    """Rank 0 handshook: its ReadDone(ok=False) frees the blocks; rank 1 gets a Cancel once it can be reached
    (dfix3: on main nothing was sent, and both held the request until their lease)."""
    m = DecodeRequest(Ident("r", "pull", "p-r", "prefill", "boot", "tok", 2, "decode", 0, 1, 2.0), 10.0)
    out = m.connections({0: RankView("ready", "h:0", "", "prefill", "boot"), 1: RankView("failed", "h:1", "no")})
    assert out == [Send(1, Cancel("p-r", "decode", 0, "tok"), ready_only=True, later=True),
                   Send(0, ReadDone("p-r", "decode", 0, 1, False, "boot", "tok")),
                   GiveStaging(), Report("failed", "handshake with prefill rank 1 at h:1 failed: no")]


def test_a_local_failure_fails_the_request_without_suspecting_the_prefill_rank() -> None:
    """A staged chunk's re-layout failed on this rank: no ``MarkStale`` (a new handshake), unlike a failed READ."""
    m = _machine("pull")
    out = m.transfer_ended(0, "re-layout of staged blocks failed: boom", local=True)
    assert not any(isinstance(a, MarkStale) for a in out)
    out = m.transfer_ended(1, "connection reset")
    assert out[0] == MarkStale(1) and out[-1] == Report("failed", "re-layout of staged blocks failed: boom")


def _push_connecting() -> DecodeRequest:
    """A push to a TP-2 prefill whose rank 0 handshook and rank 1 has not answered yet: nothing registered."""
    m = DecodeRequest(Ident("r", "push", "p-r", "prefill", "", "tok", 2, "decode", 0, 1, 2.0), 10.0)
    out = m.connections({0: RankView("ready", "h:0", "", "prefill", "boot"), 1: RankView("waiting", "h:1")})
    assert out == [] and m.phase is Phase.CONNECT
    return m


def test_a_push_aborted_before_it_registered_cancels_on_every_rank() -> None:
    """Rank 0 may hold the request's blocks: it must be told at once, not left to its lease (main at cbeed0c
    reported without a Cancel); rank 1, still handshaking, once its handshake succeeds."""
    out = _push_connecting().abort()
    cancel = Cancel("p-r", "decode", 0, "tok")  # rank 1 gets it once its handshake succeeds
    assert out == [Send(0, cancel, ready_only=True, later=True), Send(1, cancel, ready_only=True, later=True),
                   GiveStaging(), Report("failed", "aborted on the decode instance")]


def test_a_problem_on_a_push_before_it_registered_cancels_on_every_rank() -> None:
    out = _push_connecting().problem(0, "request is no longer held")
    cancel = Cancel("p-r", "decode", 0, "tok")
    assert out == [Send(0, cancel, ready_only=True, later=True), Send(1, cancel, ready_only=True, later=True),
                   GiveStaging(), Report("failed", "prefill rank 0: request is no longer held")]


def test_the_docs_list_exactly_the_machines_transitions() -> None:
    text = DOCS.read_text()
    block = re.search(r"<!-- decode-transitions:begin -->\n(.*?)\n<!-- decode-transitions:end -->", text, re.S)
    assert block is not None, "docs/disagg.md lost its decode-transitions block"
    assert block.group(1) == transitions_table(), "docs/disagg.md: paste decode_request.transitions_table() in"
    assert {a for a, _, _ in TRANSITIONS} | {b for _, _, b in TRANSITIONS} == set(Phase)
