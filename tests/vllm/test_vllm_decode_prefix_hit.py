"""A decode whose own prefix cache holds the first blocks of a prompt receives only the rest, under vLLM's real
``Scheduler`` on both sides (``realsched.py``), for pull, push and layer-wise push, with one KV-cache group and
with a hybrid full + sliding-window model (two groups).

Request ``d0`` leaves its 3 full blocks (48 tokens) in the decode's prefix cache; ``d1`` shares those 48 tokens
and has 22 of its own. vLLM counts the 48 as computed locally and 22 as external: the transfer moves the 2
blocks holding those 22 tokens in every layer, not the 5 of the prompt (on main it moved all 5, rewriting the
prefix-cache hits with equal bytes). The decode's KV equals the prefill's in every block the prompt uses, and
``vllm:kvplane_connector_events_total{event="receive_skipped_blocks"}`` on vLLM's ``/metrics`` counts the blocks
left out (in the hybrid model the sliding-window group's hit range holds one real block, the rest vLLM's null
block, so 3 + 1).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

import torch  # noqa: E402
from kvref import packed_kv_views  # noqa: E402
from ports import free_port  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from realsched import BLOCK, LAYERS, RealEngine, reference_digest  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402

from kvplane.metrics import recorder  # noqa: E402

SHARED = [(i * 17 + 3) % 997 for i in range(48)]  # 3 full blocks
FIRST = SHARED + [11, 12]  # d0: 50 tokens, its 3 full blocks stay in the decode's prefix cache
SECOND = SHARED + [(i * 31 + 5) % 997 for i in range(22)]  # d1: 70 tokens, the first 48 hit there
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 10.0, "transfer_timeout_s": 20.0,
         "drain_timeout_s": 1.0}
EVENT = "receive_skipped_blocks"


@pytest.fixture(autouse=True)
def fresh_metrics() -> Iterator[None]:
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


def moved_bytes() -> int:
    """P/D bytes moved in this process since it started, every flow (both engines share the recorder)."""
    return sum(recorder().total_bytes(flow, "mooncake", direction)
               for flow in ("pull", "push", "layerwise") for direction in ("read", "write"))


def layer_block_bytes(engine: RealEngine) -> int:
    """One block of one layer (K and V of every head)."""
    return engine.caches[LAYERS[0]][0].numel() * engine.caches[LAYERS[0]].element_size()


def real_blocks(engine: RealEngine, request_id: str, num_tokens: int, first: int = 0) -> int:
    """Blocks of every layer from block ``first`` on that hold the request's tokens (not vLLM's null block)."""
    return sum(1 for name in LAYERS
               for b in engine.tables[request_id][engine.group_of[name]][first : -(-num_tokens // BLOCK)] if b != 0)


def same_blocks(prefill: RealEngine, p: str, decode: RealEngine, d: str, num_tokens: int) -> list[str]:
    """Where the decode's KV for request ``d`` differs from the prefill's for ``p``: (layer, block position)."""
    differ = []
    for name in LAYERS:
        g = decode.group_of[name]
        for i in range(-(-num_tokens // BLOCK)):
            if g and (i + 1) * BLOCK <= num_tokens - decode.window:
                continue  # out of the window on both sides: vLLM's null block, nothing reads it
            n = min(BLOCK, num_tokens - i * BLOCK)
            mine, theirs = decode.tables[d][g][i], prefill.tables[p][g][i]
            for a, b in zip(packed_kv_views(decode.caches[name]), packed_kv_views(prefill.caches[name])):
                if not torch.equal(a[mine, :n], b[theirs, :n]):
                    differ.append(f"{name} block {i}")
    return differ


@pytest.mark.parametrize(("mode", "window"), [("pull", 0), ("push", 0), ("layerwise", 0), ("pull", 32),
                                              ("push", 32)])
def test_a_decode_receives_only_the_blocks_its_prefix_cache_lacks(
    model_dir: str, engines: list[RealEngine], mode: str, window: int
) -> None:
    prefill = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_producer",
                         sliding_window=window)
    decode = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_consumer",
                        prefix_caching=True, sliding_window=window)
    engines.extend([prefill, decode])

    def receive(i: int, prompt: list[int]) -> int:
        """Bytes the transfer of request ``i`` moved."""
        before = moved_bytes()
        prefill.add(f"p{i}", prompt, {"do_remote_decode": True})
        decode.add(f"d{i}", prompt, prefill.finish(f"p{i}").kv_transfer_params)

        def prefill_steps_too() -> bool:
            prefill.step()  # vLLM keeps stepping the prefill engine while has_pending_push_work()
            return f"d{i}" in decode.outputs

        decode.run_until(prefill_steps_too)
        assert decode.first_computed[f"d{i}"] == len(prompt) - 1 and not decode.invalid and not decode.failed
        assert decode.digests[f"d{i}"] == reference_digest(prompt, len(prompt), window=window)
        assert same_blocks(prefill, f"p{i}", decode, f"d{i}", len(prompt)) == []
        return moved_bytes() - before

    assert receive(0, FIRST) == real_blocks(decode, "d0", len(FIRST)) * layer_block_bytes(decode)
    skipped_before = sum(s.kv_connector_stats.get(EVENT, 0) for s in decode.stats if s.kv_connector_stats)
    moved = receive(1, SECOND)
    assert decode.tables["d1"][0][:3] == decode.tables["d0"][0][:3]  # vLLM's own prefix-cache hit
    assert real_blocks(decode, "d1", len(SECOND), first=3) == 2 * len(LAYERS)
    assert moved == 2 * len(LAYERS) * layer_block_bytes(decode), \
        f"moved {moved // layer_block_bytes(decode)} layer-blocks, the 22 tokens the decode lacks fill 2 per layer"
    skipped = sum(s.kv_connector_stats.get(EVENT, 0) for s in decode.stats if s.kv_connector_stats)
    assert skipped - skipped_before == (3 if not window else 4)

    prom = PrometheusStatLogger(decode.config, engine_indexes=[0])
    for stats in decode.stats:
        prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    model = decode.config.model_config.served_model_name
    assert REGISTRY.get_sample_value("vllm:kvplane_connector_events_total",
                                     {"model_name": model, "engine": "0", "event": EVENT}) == skipped
    prefill.drain()
    decode.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()
