"""Cross-vendor P/D: an Ascend-shaped prefill feeding a CUDA-shaped decode, and the reverse, each in its own process.

The two sides differ in everything at once. The npu rank (emulated: kvplane's Ascend backend over host memory)
holds vllm-ascend's caches: ``(k, v)`` tuples of separate 2 MiB-aligned allocations, MLA as ``(nope, rope)``,
block size 128, its registration merged under the 2 MiB / 256-region rules. The cuda rank (emulated: the cpu
backend wearing the cuda backend's facts) holds vLLM's packed ``(nb, heads, bs, 2*dim)`` caches, MLA fused 576-wide
in the real model, block size 16. Bytes move through Mooncake TE or NIXL on 127.0.0.1 with protocol ``tcp`` on both
sides (the one this machine has for both); the decode's tokens and logits must equal one process's, bit for bit.
Where the two sides' protocols share nothing (``ascend`` against ``rdma``), the handshake fails before any byte
moves, naming both sides. Emulated devices throughout: this proves kvplane's code paths, not the hardware.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
from e2e_run import Side, check
from pair import Engine, until
from rank_pool import Pool
from vendors import ALIGN, ascend_cache, backend_for

from kvplane.blocks.pool import BlockPool
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec
from kvplane.testing.emulated import uninstall_emulated

pytestmark = pytest.mark.integration

NPU = {"gqa": Side("gqa", "split_kv", 128, device="npu-emulated"),
       "mla": Side("mla", "mla_split", 128, device="npu-emulated")}
CUDA = {"gqa": Side("gqa", "packed_kv", 16, device="cuda-emulated"),
        "mla": Side("mla", "mla_fused", 16, device="cuda-emulated")}
CASES = [  # (family, mode, engine, npu side prefills): every mode and both families from the npu, two back
    ("gqa", "pull", "mooncake", True), ("gqa", "push", "nixl", True), ("gqa", "layerwise", "mooncake", True),
    ("mla", "pull", "nixl", True), ("mla", "push", "mooncake", True), ("mla", "layerwise", "nixl", True),
    ("gqa", "push", "mooncake", False), ("mla", "pull", "mooncake", False),
]


@pytest.mark.parametrize("family,mode,engine,npu_first", CASES,
                         ids=[f"{'npu-to-cuda' if n else 'cuda-to-npu'}-{f}-{m}-{e}" for f, m, e, n in CASES])
def test_a_cross_vendor_pair_decodes_exactly_as_one_process(pool: Pool, family: str, mode: str, engine: str,
                                                            npu_first: bool) -> None:
    prefill, decode = (NPU[family], CUDA[family]) if npu_first else (CUDA[family], NPU[family])
    check(pool, prefill, decode, engine, mode, protocol="tcp")


@pytest.fixture
def vendors() -> Iterator[None]:
    yield
    uninstall_emulated("npu")


@pytest.mark.usefixtures("vendors")
def test_sides_whose_mooncake_protocols_share_nothing_fail_at_the_handshake_naming_both_before_any_byte_moves(
) -> None:
    spec = KVSpec.gqa(2, 2, 8, tokens_per_block=128, dtype="float32")
    decode_spec = KVSpec.gqa(2, 2, 8, tokens_per_block=16, dtype="float32")
    npu, cuda = backend_for("npu-emulated"), backend_for("cuda-emulated")
    settings = {"transport": "mooncake", "handshake_timeout_s": 30.0, "transfer_timeout_s": 30.0,
                "lease_s": 5.0, "heartbeat_s": 1.0}
    prefill = PrefillSide(bind(npu, spec, ascend_cache(spec, "split_kv", 8), "split_kv"),
                          DisaggConfig(engine_id=f"p-{uuid.uuid4().hex[:6]}", **settings))
    cache = allocate_cache(decode_spec, "packed_kv", 64)
    decode = Engine(DecodeSide(bind(cuda, decode_spec, cache, "packed_kv"), DisaggConfig(engine_id="d", **settings)),
                    decode_spec, cache, "packed_kv", BlockPool(64))
    try:
        params = prefill.request_finished("r1", {0: [3]}, 100)
        decode.side.start_pull("r1", params, {0: decode.allocate(100)}, 100)
        done = decode.wait("r1")
        assert done.state == "failed"
        for words in ("npu-emulated speaking ascend", "cuda-emulated speaking rdma", "no transport in common",
                      "'tcp'", "KVPLANE_MOONCAKE_PROTOCOL", "USE_ASCEND_HETEROGENEOUS"):
            assert words in done.reason, (words, done.reason)
        assert decode.side.local.transport.submitted.descriptors == 0
        assert prefill.local.transport.submitted.descriptors == 0
        assert all(not t.any() for v in cache.values() for t in ((v,) if isinstance(v, torch.Tensor) else v))
        released: list[str] = []
        until("the prefill gives the refused request's blocks back when its lease ends",
              lambda: bool(released.extend(c.state for c in prefill.get_finished()) or released), 60.0)
        assert released == ["timed_out"] and prefill.held_requests() == 0
    finally:
        decode.close()
        prefill.close()


@pytest.mark.usefixtures("vendors")
def test_the_npu_rank_registers_its_separate_allocations_under_the_ascend_rules() -> None:
    """vllm-ascend's allocations are registered widened to 2 MiB (those that then touch merged into one), every
    cache tensor inside a registered span; the 256-region cap is the backend's rule (``test_cpu_backend``)."""
    npu = backend_for("npu-emulated")
    spec = KVSpec.mla(2, kv_lora_rank=16, rope_dim=4, tokens_per_block=128, dtype="float32")
    cache = ascend_cache(spec, "mla_split", 8)
    side = PrefillSide(bind(npu, spec, cache, "mla_split"), DisaggConfig(engine_id="p-regions", transport="mooncake"))
    try:
        spans = side.local.transport.peer_info().spans
    finally:
        side.close()
    assert 1 <= len(spans) <= 4 and all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in spans)
    for value in cache.values():
        for t in value if isinstance(value, tuple) else (value,):
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            assert any(a <= start and end <= a + n for a, n in spans), "a cache tensor outside every span"
