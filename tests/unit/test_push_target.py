"""A push target's phases (``push_target.py``): the table docs/disagg.md carries is the one the code enforces, it is
sound (every phase reached, only ``REPORTED`` ends), and ``Target.to`` refuses a change the table does not list."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvplane.flows.disagg.prefill.push_target import TRANSITIONS, Target, TargetPhase
from kvplane.machines import reachable, transitions_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"


def test_the_docs_carry_the_push_targets_table() -> None:
    block = re.search(r"<!-- push-target:begin -->\n(.*?)\n<!-- push-target:end -->", DOCS.read_text(), re.S)
    assert block is not None, "docs/disagg.md: the push target's table is missing"
    assert block.group(1) == transitions_table(TRANSITIONS), "paste transitions_table(push_target.TRANSITIONS) in"


def test_every_phase_is_reached_and_only_reported_ends() -> None:
    assert reachable(TRANSITIONS, TargetPhase.UNCHECKED) == set(TargetPhase)
    assert {a for a, _, _ in TRANSITIONS} == set(TargetPhase) - {TargetPhase.REPORTED}


@pytest.mark.parametrize("start,to", [(TargetPhase.REPORTED, TargetPhase.CHECKED),
                                      (TargetPhase.UNCHECKED, TargetPhase.STREAMING),
                                      (TargetPhase.STREAMING, TargetPhase.CHECKED)])
def test_a_change_the_table_does_not_list_is_refused(start: TargetPhase, to: TargetPhase) -> None:
    nobody: Any = None
    target = Target(nobody, nobody, [], start)
    with pytest.raises(RuntimeError, match=f"{start.name} -> {to.name} is not in TRANSITIONS"):
        target.to(to)
    assert target.phase is start
