"""The bench's serve rows (kvplane.bench.serve.rows): the vLLM command has one source, and one row runs end to end.

The command check needs no server: docs/vllm.md's `# serve: vllm` line equals the product template that the bench
and tests/serve both start (`kvplane.bench.serve.command.VLLM_COMMAND`). The end-to-end row costs three server
starts, so it runs only under `make test-serve-full` (`KVPLANE_SERVE_FULL=1`); no timing is asserted.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from servers import FULL, SERVE_PY, doc_command, vllm_argv

from kvplane.bench.serve import command


def test_the_docs_command_is_the_product_template() -> None:
    assert shlex.split(doc_command("vllm")) == shlex.split(command.VLLM_COMMAND)


def test_the_tests_argv_is_the_template_filled_in() -> None:
    argv = vllm_argv(Path("/m"), 8100, None, "1")
    assert argv[:3] == ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=1", str(SERVE_PY)]
    assert "--kv-transfer-config" not in argv and argv[-2:] == ["--dtype", "float32"]
    kv = {"kv_connector": "KVPlaneConnector"}
    argv = vllm_argv(Path("/m"), 8100, kv, "0")
    assert argv[argv.index("--kv-transfer-config") + 1] == '{"kv_connector":"KVPlaneConnector"}'


@pytest.mark.integration
@pytest.mark.skipif(not FULL, reason="three server starts: make test-serve-full (KVPLANE_SERVE_FULL=1) runs it")
def test_a_serve_pd_row_runs_end_to_end_and_reports_sane_figures() -> None:
    from kvplane.backend import get_backend
    from kvplane.bench.serve import rows

    try:
        r = rows.pd_scenario("pull", "mooncake").run(get_backend("cpu"), True)
    finally:
        rows.release()
    assert r.kind == "serve" and r.scenario == "serve-pd-pull-mooncake" and r.transport == "mooncake"
    assert r.verified, r.params
    assert r.reps >= 5 and r.seconds > 0 and r.baseline_seconds > 0 and r.ratio > 0
    p = r.params
    assert p["ttft_ratio"] > 0 and p["e2e_ratio"] > 0 and p["e2e_ms"] >= p["ttft_ms"] > 0
    assert set(p["start_s"]) == {"prefill", "decode", "proxy", "plain"}
    assert p["decode_prompt_tokens_by_source"].get("external_kv_transfer", 0) > 0
    assert r.bytes > 0
