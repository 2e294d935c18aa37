"""docs/disagg.md draws the prefill request machine exactly as ``held_request.TRANSITIONS`` declares it, and the
table itself is sound: every phase is reached from the start, only terminal phases have no way out, and nothing
leaves a terminal phase."""

from __future__ import annotations

import re
from pathlib import Path

from kvplane.flows.disagg.prefill.held_request import TERMINAL, TRANSITIONS, Phase, render_transitions
from kvplane.machines import reachable

DOCS = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"
BLOCK = re.compile(r"<!-- prefill-machine:begin -->\n```mermaid\n(.*?)\n```\n<!-- prefill-machine:end -->", re.S)


def test_the_docs_draw_exactly_the_declared_transitions() -> None:
    found = BLOCK.findall(DOCS.read_text())
    assert len(found) == 1, f"{DOCS}: one prefill-machine block expected, found {len(found)}"
    assert found[0] == render_transitions(), (
        "docs/disagg.md's prefill machine differs from held_request.TRANSITIONS; paste "
        "held_request.render_transitions() between the prefill-machine markers")
    edges = {(a, event, b) for a, b, event in re.findall(r"^ {4}(\w+) --> (\w+): (\w+)$", found[0], re.M)
             if a != "[*]" and b != "[*]"}
    assert edges == {(a.name, event, b.name) for a, event, b in TRANSITIONS}


def test_every_phase_is_reached_and_only_terminal_ones_end() -> None:
    assert reachable(TRANSITIONS, Phase.EARLY) == set(Phase)
    assert {a for a, _, _ in TRANSITIONS} == set(Phase) - TERMINAL
    assert all(a is not b for a, _, b in TRANSITIONS)
