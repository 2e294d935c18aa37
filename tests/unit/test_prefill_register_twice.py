"""A push registration that comes again for a target whose WRITE is running: the prefill machine must never
let go of that target, or it releases the blocks (the engine reuses them) while its own WRITE still reads them
and tells the decode the rank is done writing while bytes may still land. Found by the joint hypothesis test
(``test_pd_machines_joint.py``) with a repeated ``PushRegister``.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from kvplane.flows.disagg.prefill.held_request import HeldRequest, Release, Send, Terms, Write
from kvplane.flows.disagg.wire.messages import Problem, PushRegister, PushResult
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.kv.manifest import Manifest

TERMS = Terms(rank=0, lease_s=10.0, push_timeout_s=5.0)
DECODE = b"decode/0"
PEER = PeerRecord("decode", 0, 1, "boot", cast(Manifest, None), "decode/0", DECODE)


def register(blocks: list[int]) -> PushRegister:
    return PushRegister("r", "decode", 0, 1, {0: blocks}, 16, 0, 0, "boot", "tok")


def writing() -> tuple[HeldRequest, Write]:
    m = HeldRequest("r", TERMS)
    m.finish({0: np.arange(1, dtype=np.int64)}, 16, "tok", 0.0)
    writes = [a for a in m.register(DECODE, PEER, register([7]), ["l0"]) if isinstance(a, Write)]
    assert len(writes) == 1
    return m, writes[0]


def test_the_same_registration_again_changes_nothing() -> None:
    m, write = writing()
    assert m.register(DECODE, PEER, register([7]), ["l0"]) == []
    out = m.write_ended(write.target, "")
    assert [a.message.ok for a in out if isinstance(a, Send) and isinstance(a.message, PushResult)] == [True]
    assert [a.completion.state for a in out if isinstance(a, Release)] == ["done"]


def test_another_registration_while_the_write_runs_fails_the_push_only_after_the_write_ended() -> None:
    m, write = writing()
    out = m.register(DECODE, PEER, register([8]), ["l0"])
    assert [type(a.message) for a in out if isinstance(a, Send)] == [Problem]
    assert not any(isinstance(a, Release | Write) for a in out), out  # the running WRITE still reads the blocks
    assert not any(isinstance(a, Send) and isinstance(a.message, PushResult) for a in out)
    out = m.write_ended(write.target, "")
    results = [a.message for a in out if isinstance(a, Send) and isinstance(a.message, PushResult)]
    assert [r.ok for r in results] == [False] and "registered twice" in results[0].reason
    assert [a.completion.state for a in out if isinstance(a, Release)] == ["failed"]


def test_a_layerwise_request_still_computing_is_not_released_by_the_deadline_of_early_word() -> None:
    """The decode registered before ``start_request``: the machine was made with the early word's deadline
    (``push_timeout_s``). Once the engine handed the request over, only ``finish`` or ``abort`` may end it while it
    computes; a Release mid-forward gave the engine blocks its forward still writes. Found in review."""
    m = HeldRequest("r", TERMS, deadline=TERMS.push_timeout_s)  # as PrefillSide makes it for early word
    m.register(DECODE, PEER, register([7]), ["l0"])
    m.start({0: np.arange(1, dtype=np.int64)}, 16, "tok")
    assert not [a for a in m.tick(TERMS.push_timeout_s + 1.0) if isinstance(a, Release)]
    out = m.abort()
    assert [a.completion.state for a in out if isinstance(a, Release)] == ["failed"]
