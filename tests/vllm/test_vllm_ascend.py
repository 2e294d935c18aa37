"""Ascend-shaped KV caches on the emulated npu: vllm-ascend hands ``register_kv_caches`` a (k, v) tuple per layer;
the connector takes them as they come, picks the npu backend from ``KVPLANE_DEVICE`` and moves the bytes.
Emulated: device memory is host memory, so this proves the connector's and the backend's code paths, not
Ascend hardware."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

import torch  # noqa: E402
from minivllm import MiniEngine  # noqa: E402
from ports import free_port  # noqa: E402

from kvplane.backend.registry import default_registry  # noqa: E402
from kvplane.testing.backends import register_emulated  # noqa: E402
from kvplane.testing.emulated import uninstall_emulated  # noqa: E402

PROMPT = [(i * 29 + 3) % 983 for i in range(75)]


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    register_emulated(default_registry(), "npu")  # a test double: used only where named, as here
    monkeypatch.setenv("KVPLANE_DEVICE", "npu-emulated")
    yield
    uninstall_emulated("npu")


@pytest.mark.usefixtures("npu")
def test_split_kv_tuples_offload_and_load_back_on_the_emulated_npu() -> None:
    engine = MiniEngine({"offload": {"host_bytes": 4 << 20}}, split_kv=True)
    try:
        backend = engine.worker._worker.backend
        assert backend.name == "npu-emulated" and backend.emulated
        assert engine.worker._worker.offload is not None
        first_layer = engine.worker._worker.spec.layer_names[0]
        assert {r.slot for r in engine.worker._worker.offload.pool.regions[first_layer]} == {"k", "v"}
        engine.run("a", PROMPT)
        again = engine.run("b", PROMPT)
        assert again.external_tokens == 64 and not again.load_errors
        assert again.digest == engine.reference_digest(PROMPT, len(PROMPT)) and engine.whole
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("npu")
def test_split_kv_tuples_pull_from_an_ascend_prefill_in_one_process() -> None:
    disagg = {"mode": "pull", "lease_s": 10.0, "heartbeat_s": 0.5}
    prefill = MiniEngine({"disagg": {**disagg, "port": free_port()}}, "kv_producer", split_kv=True)
    decode = MiniEngine({"disagg": {**disagg, "port": free_port()}}, "kv_consumer", split_kv=True)
    try:
        done = prefill.run("p-1", PROMPT, {"do_remote_decode": True})
        received = decode.run("d-1", PROMPT, done.kv_transfer_params)
        prefill.pump("p-1")
        assert received.external_tokens == len(PROMPT) and not received.load_errors
        assert received.digest == done.digest == decode.reference_digest(PROMPT, len(PROMPT))
        assert prefill.whole and decode.whole
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.usefixtures("npu")
def test_mla_nope_and_rope_tuples_offload_and_load_back_on_the_emulated_npu() -> None:
    engine = MiniEngine({"offload": {"host_bytes": 4 << 20}}, split_kv=True, mla=True)
    try:
        spec = engine.worker._worker.spec
        assert [(s.name, s.head_dim) for s in spec.layers[0].slots] == [("kv_c", 16), ("k_pe", 64)]
        engine.run("a", PROMPT)
        again = engine.run("b", PROMPT)
        assert again.external_tokens == 64 and not again.load_errors
        assert again.digest == engine.reference_digest(PROMPT, len(PROMPT)) and engine.whole
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("npu")
def test_a_cuda_style_fused_mla_prefill_feeds_an_ascend_style_split_mla_decode() -> None:
    disagg = {"mode": "pull", "lease_s": 10.0, "heartbeat_s": 0.5}
    prefill = MiniEngine({"device": "cpu", "disagg": {**disagg, "port": free_port()}}, "kv_producer", mla=True)
    # the cpu prefill's Mooncake speaks tcp, the npu's ascend by default: across devices both must say one (tcp)
    decode = MiniEngine({"device": "npu-emulated", "disagg": {**disagg, "port": free_port(), "protocol": "tcp"}},
                        "kv_consumer", mla=True, split_kv=True)
    try:
        assert isinstance(prefill.caches[next(iter(prefill.caches))], torch.Tensor)  # (nb, bs, 80)
        done = prefill.run("p-1", PROMPT, {"do_remote_decode": True})
        received = decode.run("d-1", PROMPT, done.kv_transfer_params)
        prefill.pump("p-1")
        assert received.external_tokens == len(PROMPT) and not received.load_errors
        assert received.digest == done.digest == decode.reference_digest(PROMPT, len(PROMPT))
        assert prefill.whole and decode.whole
    finally:
        prefill.shutdown()
        decode.shutdown()
