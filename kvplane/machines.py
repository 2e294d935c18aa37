"""What kvplane's state machines share: each declares its transitions as ``(from, event, to)`` rows (phases as
Enum members, or names), and the docs carry them as a markdown table that a unit test keeps equal to
``transitions_table(rows)``; ``reachable`` is what a sound table reaches from its start."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


def transitions_table(rows: Iterable[tuple[Enum | str, str, Enum | str]]) -> str:
    """The rows as the markdown table the docs carry."""
    def name(phase: Enum | str) -> str:
        return phase if isinstance(phase, str) else phase.name

    lines = [f"| `{name(a)}` | {why} | `{name(b)}` |" for a, why, b in rows]
    return "\n".join(["| from | event | to |", "|---|---|---|", *lines])


def reachable(rows: Iterable[tuple[Enum, str, Enum]], start: Enum) -> set[Enum]:
    """The phases ``rows`` lead to from ``start`` (``start`` included): what a sound table reaches whole."""
    table = list(rows)
    reached, frontier = {start}, [start]
    while frontier:
        here = frontier.pop()
        for a, _, b in table:
            if a is here and b not in reached:
                reached.add(b)
                frontier.append(b)
    return reached
