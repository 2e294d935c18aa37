"""Tensor parallelism through the connector: one worker connector per TP rank (each holding its share of the
heads), vLLM's rule that a request is finished once every rank reported it, rank r's side channel on port + r."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from minivllm import MiniEngine, engine_parallel_config  # noqa: E402
from ports import free_port, free_ports  # noqa: E402

PROMPT = [(i * 41 + 7) % 977 for i in range(90)]


@pytest.mark.parametrize("prefill_dp_rank", [0, 1], ids=["dp0", "dp1"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_decode_pulls_every_heads_share_from_the_prefill_ranks(prefill_tp: int, decode_tp: int,
                                                               prefill_dp_rank: int) -> None:
    """The prefill is DP rank ``prefill_dp_rank`` of two (vLLM's ``data_parallel_index``): its TP ranks listen from
    ``port + dp_rank * tp_size``, and a decode of another TP size (DP rank 0) reaches each from ``remote_port``."""
    disagg = {"mode": "pull", "lease_s": 10.0, "heartbeat_s": 0.5}
    port = free_ports(2 * prefill_tp)
    base = port + prefill_dp_rank * prefill_tp
    prefill = MiniEngine({"disagg": {**disagg, "port": port}}, "kv_producer", tp_size=prefill_tp,
                         engine_id=f"p_dp{prefill_dp_rank}",
                         parallel=engine_parallel_config(2, prefill_dp_rank, prefill_tp, moe=False))
    decode = MiniEngine({"disagg": {**disagg, "port": free_port()}}, "kv_consumer", tp_size=decode_tp,
                        engine_id="d_dp0", parallel=engine_parallel_config(2, 0, decode_tp, moe=False))
    try:
        assert [w._worker.prefill.port for w in prefill.workers] == [base + r for r in range(prefill_tp)]
        done = prefill.run("p-1", PROMPT, {"do_remote_decode": True})
        assert (done.kv_transfer_params["tp_size"], done.kv_transfer_params["remote_port"]) == (prefill_tp, base)
        received = decode.run("d-1", PROMPT, done.kv_transfer_params)
        prefill.pump("p-1")
        assert received.external_tokens == len(PROMPT) and not received.load_errors
        assert received.digest == done.digest == decode.reference_digest(PROMPT, len(PROMPT))
        assert prefill.whole and decode.whole
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_offload_with_two_ranks_looks_up_rank_0_and_loads_on_both() -> None:
    engine = MiniEngine({"offload": {"host_bytes": 4 << 20, "pinned": False}}, tp_size=2)
    try:
        assert engine.workers[0]._worker.lookup_server is not None
        assert engine.workers[1]._worker.lookup_server is None
        engine.run("a", PROMPT)
        again = engine.run("b", PROMPT)
        assert again.external_tokens == 80 and not again.load_errors
        assert again.digest == engine.reference_digest(PROMPT, len(PROMPT)) and engine.whole
    finally:
        engine.shutdown()
