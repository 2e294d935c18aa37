"""The phases of a prefill rank's ``HeldRequest`` (``held_request.py``) and every change between them.

``Phase`` says where a request stands; ``TERMINAL`` are the phases nothing leaves. ``TRANSITIONS`` lists every
phase change the machine makes, named by the event (the machine's method) that made it; docs/disagg.md draws
the table as a state diagram (``render_transitions``), and a unit test checks that the two agree and that the
machine takes no other path.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    EARLY = "early"  # the engine has not handed the request over (a decode rank's word came first)
    COMPUTING = "computing"  # start_request (layer-wise): the prompt is computing; saved layers are pushed
    HELD = "held"  # request_finished: the blocks are held for decode ranks to read or be pushed, under a lease
    ABORTED = "aborted"  # the engine aborted it mid-prefill: released once the writes in flight ended
    RELEASED = "released"  # its one Completion was issued; nothing more happens to it
    DROPPED = "dropped"  # early word expired and the engine never handed it over: nothing of the engine's held


TERMINAL = frozenset({Phase.RELEASED, Phase.DROPPED})

# Every phase change (from, event, to); events are the machine's method names.
TRANSITIONS: frozenset[tuple[Phase, str, Phase]] = frozenset({
    (Phase.EARLY, "start", Phase.COMPUTING),
    (Phase.EARLY, "finish", Phase.HELD),
    (Phase.EARLY, "tick", Phase.DROPPED),
    (Phase.COMPUTING, "finish", Phase.HELD),
    (Phase.COMPUTING, "abort", Phase.ABORTED),
    (Phase.ABORTED, "abort", Phase.RELEASED),
    (Phase.ABORTED, "write_ended", Phase.RELEASED),
    (Phase.HELD, "finish", Phase.RELEASED),
    (Phase.HELD, "read_done", Phase.RELEASED),
    (Phase.HELD, "register", Phase.RELEASED),
    (Phase.HELD, "cancel", Phase.RELEASED),
    (Phase.HELD, "write_ended", Phase.RELEASED),
    (Phase.HELD, "plan_failed", Phase.RELEASED),
    (Phase.HELD, "peer_lost", Phase.RELEASED),
    (Phase.HELD, "tick", Phase.RELEASED),
})


def render_transitions() -> str:
    """The transition table as the mermaid state diagram docs/disagg.md shows (sorted, one edge a line)."""
    order = list(Phase)
    edges = sorted(TRANSITIONS, key=lambda t: (order.index(t[0]), order.index(t[2]), t[1]))
    lines = ["stateDiagram-v2", "    [*] --> EARLY: the first event (the engine's or a decode rank's)"]
    lines += [f"    {a.name} --> {b.name}: {event}" for a, event, b in edges]
    lines += ["    RELEASED --> [*]", "    DROPPED --> [*]"]
    return "\n".join(lines)
