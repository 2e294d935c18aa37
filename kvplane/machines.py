"""What kvplane's state machines share: each declares its transitions as ``(from, event, to)`` rows (phases as
Enum members, or names), and the docs carry them as a markdown table that a unit test keeps equal to
``transitions_table(rows)``."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


def transitions_table(rows: Iterable[tuple[Enum | str, str, Enum | str]]) -> str:
    """The rows as the markdown table the docs carry."""
    def name(phase: Enum | str) -> str:
        return phase if isinstance(phase, str) else phase.name

    lines = [f"| `{name(a)}` | {why} | `{name(b)}` |" for a, why, b in rows]
    return "\n".join(["| from | event | to |", "|---|---|---|", *lines])
