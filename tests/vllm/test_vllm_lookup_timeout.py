"""A host-tier lookup that the scheduler gave up on (``lookup_timeout_s``) leaves nothing held on the worker:
the worker may still answer it, late, and hold host blocks for it; vLLM's real ``Scheduler`` drives the
scheduler half, TP rank 0's worker answers over its ``ipc://`` socket (see ``lookup.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from realsched import RealEngine, reference_digest  # noqa: E402
from test_vllm_async_lookup import BLOCK_BYTES, fill_host_tier, prompt  # noqa: E402

from kvplane.integrations.vllm.lookup import LookupClient  # noqa: E402


def test_a_lookup_answered_after_the_scheduler_gave_up_holds_no_host_blocks_once_the_request_ends(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 16 * BLOCK_BYTES, "pinned": False},
                                    "lookup_timeout_s": 0.05})
    engines.append(engine)
    fill_host_tier(engine, 1)
    worker, client = engine.worker.worker, engine.scheduler.connector.scheduler.lookup
    engine.add("c", prompt(1))
    with worker._lock:  # the worker is busy (a store, a slow store-tier query): the lookup is not answered in time
        so = engine.scheduler.schedule()
    # the worker answers c's lookup now, to nobody; a lookup on a fresh socket is answered after it
    probe = LookupClient(client.address, timeout_s=30.0)
    assert probe.hold("probe", {0: []}, {0: 16}) == 0
    probe.close()
    engine._track_blocks(so)
    engine._execute(so)
    assert engine.finish("c").finish_reason is not None
    assert engine.first_computed["c"] == 0  # the lookup counted as a miss
    assert engine.digests["c"] == reference_digest(prompt(1), 70)
    engine.drain()
    engine.assert_nothing_held()
