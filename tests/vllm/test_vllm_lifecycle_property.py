"""Lifecycle invariants of the scheduler-side connector as a hypothesis state machine, under vLLM's real
``Scheduler`` (``realsched.RealEngine`` without a worker): random sequences of add, step (which preempts when
blocks run out), client abort, receive done or failed, send done, for both kv roles that transfer, pull and
push, and both failure policies. The worker half is played by its contract (``PlayedWorker``): what the
metadata starts ends once, an abort of a receive still arriving ends it as a send, an abort after the end is
nothing. After every sequence: each request was finished to the connector exactly once and ended in vLLM
exactly once, vLLM's scheduler is empty, every table of the connector is empty, no push work is pending."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402
from realsched import RealEngine, tiny_model_dir  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

MODEL_DIR = tiny_model_dir(Path(__import__("tempfile").mkdtemp(prefix="kvplane-lifecycle-")))


class PlayedWorker:
    """The worker half's answers, by its contract (``WorkerSide.get_finished``)."""

    def __init__(self) -> None:
        self.receiving: dict[str, list[int]] = {}  # request -> its blocks (all fail on a failed receive)
        self.sending: set[str] = set()
        self.aborted: set[str] = set()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.invalid: set[int] = set()
        self.reported: Counter[str] = Counter()

    def take(self, meta: Any) -> None:
        for rid in meta.aborts:
            if rid in self.receiving:
                self.aborted.add(rid)
        for r in meta.receives:
            self.receiving[r.request_id] = [b for ids in r.block_ids.values() for b in ids]
        for s in meta.sends:
            self.sending.add(s.request_id)

    def end_receive(self, rid: str, ok: bool) -> None:
        blocks = self.receiving.pop(rid)
        if rid in self.aborted:
            self.aborted.discard(rid)
            self.finished_sending.add(rid)
            return
        if not ok:
            self.invalid.update(blocks)
        self.finished_recving.add(rid)

    def end_send(self, rid: str) -> None:
        self.sending.discard(rid)
        self.finished_sending.add(rid)

    def output(self) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_sending=self.finished_sending or None,
                                finished_recving=self.finished_recving or None, invalid_block_ids=self.invalid)
        self.reported.update(self.finished_sending | self.finished_recving)
        self.finished_sending, self.finished_recving, self.invalid = set(), set(), set()
        return out


class Lifecycle(RuleBasedStateMachine):
    engine: RealEngine

    @initialize(role=st.sampled_from(["kv_producer", "kv_consumer", "kv_both"]), mode=st.sampled_from(["pull", "push"]),
                policy=st.sampled_from(["recompute", "fail"]))
    def start(self, role: str, mode: str, policy: str) -> None:
        self.role, self.mode = role, mode
        self.engine = RealEngine(MODEL_DIR, {"disagg": {"mode": mode, "port": free_port()}}, role, policy=policy,
                                 num_blocks=14, with_worker=False)
        self.worker = PlayedWorker()
        self.finished_to_connector: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()  # final outputs from vLLM, and client aborts
        connector = self.engine.scheduler.connector
        inner = connector.request_finished_all_groups

        def counted(request: Any, block_ids: Any) -> Any:
            self.finished_to_connector[request.request_id] += 1
            return inner(request, block_ids)

        connector.request_finished_all_groups = counted
        self.added: list[str] = []

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            try:
                self.everything_ends()
            finally:
                self.engine.shutdown()

    @rule(remote=st.booleans(), length=st.integers(17, 60), max_tokens=st.integers(1, 12))
    def add(self, remote: bool, length: int, max_tokens: int) -> None:
        rid = f"r{len(self.added)}"
        prompt = [(len(self.added) * 31 + i * 7) % 997 for i in range(length)]
        params: dict[str, Any] | None = None
        if remote and self.role != "kv_producer":  # a decode request: the KV comes from a prefill instance
            params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": rid,
                      "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1, "kvplane_mode": self.mode}
        elif remote:  # a prefill request: its KV goes to a decode instance
            params = {"do_remote_decode": True}
        self.engine.add(rid, prompt, params, max_tokens=max_tokens)
        self.added.append(rid)

    @rule()
    def step(self) -> None:
        engine = self.engine
        so = engine.scheduler.schedule()
        self.worker.take(so.kv_connector_metadata)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = engine.scheduler.requests[rid]  # schedule() already counted the scheduled tokens
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=self.worker.output())
        for outs in engine.scheduler.update_from_output(so, output).values():
            for out in outs.outputs:
                if out.finish_reason is not None:
                    self.ended[out.request_id] += 1

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r for r in self.added if r in self.engine.scheduler.requests
                and not self.engine.scheduler.requests[r].is_finished()]
        if live:
            rid = data.draw(st.sampled_from(live))
            self.engine.abort(rid)
            self.ended[rid] += 1

    @precondition(lambda self: bool(self.worker.receiving))
    @rule(data=st.data(), ok=st.booleans())
    def receive_ends(self, data: st.DataObject, ok: bool) -> None:
        self.worker.end_receive(data.draw(st.sampled_from(sorted(self.worker.receiving))), ok)

    @precondition(lambda self: bool(self.worker.sending))
    @rule(data=st.data())
    def send_ends(self, data: st.DataObject) -> None:
        self.worker.end_send(data.draw(st.sampled_from(sorted(self.worker.sending))))

    @invariant()
    def reported_once(self) -> None:
        if hasattr(self, "worker"):
            assert max(self.worker.reported.values(), default=0) <= 1, self.worker.reported
            assert max(self.finished_to_connector.values(), default=0) <= 1, self.finished_to_connector

    def drain(self) -> None:
        """Every transfer ends (successfully) and the engine steps until vLLM holds nothing."""
        for _ in range(400):
            for rid in sorted(self.worker.receiving):
                self.worker.end_receive(rid, True)
            for rid in sorted(self.worker.sending):
                self.worker.end_send(rid)
            scheduler = self.engine.scheduler
            if not scheduler.has_requests() and not scheduler.requests and not self.worker.receiving \
                    and not self.worker.sending:
                return
            self.step()
        raise AssertionError(f"still held after 400 steps: {list(self.engine.scheduler.requests)}")

    @rule()
    def everything_ends(self) -> None:
        self.drain()
        scheduler = self.engine.scheduler
        assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
        assert not scheduler.finished_recving_kv_req_ids and not scheduler.failed_recving_kv_req_ids
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        assert self.finished_to_connector == Counter(self.added), (self.finished_to_connector, self.added)
        assert self.ended == Counter(self.added), (self.ended, self.added)
        held = scheduler.connector.scheduler.held_request_ids()
        assert not any(held.values()), {k: v for k, v in held.items() if v}
        assert not scheduler.connector.has_pending_push_work()


Lifecycle.TestCase.settings = settings(max_examples=20, stateful_step_count=20, deadline=None,
                                       suppress_health_check=list(HealthCheck))
test_every_request_ends_once_on_every_path = Lifecycle.TestCase
