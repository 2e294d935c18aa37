"""Side-channel ports under vLLM's data parallelism: every (DP rank, TP rank) of one host listens on its own port,
and the scheduler of each DP rank advertises the base port of its own ranks.

The parallel configs are vLLM's own ``ParallelConfig``, set up as ``EngineCoreProc.run_engine_core``
(vllm/v1/engine/core.py) sets up each DP engine process: ``data_parallel_index`` is the DP rank, and for a dense
(non-MoE) model ``data_parallel_rank`` is reset to 0 (0.33: ``reconfigure_for_independent_dp_rank``), which is
why kvplane cannot use ``data_parallel_rank`` to tell DP ranks apart. Each DP engine's ``engine_id`` carries
vLLM's ``_dp{rank}`` suffix, as core.py appends it. Each DP engine is a ``MiniEngine`` (minivllm.py): vLLM's
connector factory builds its scheduler and TP worker connectors, whose side channels really bind, and requests
are vLLM ``Request`` objects.
"""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from minivllm import MiniEngine, engine_parallel_config  # noqa: E402
from ports import free_ports  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvplane.flows.disagg.wire.params import TransferParams  # noqa: E402
from kvplane.integrations.vllm import KVPlaneConnector  # noqa: E402

BLOCK = 16
BASE = 5600
PROMPT = [(i * 41 + 7) % 977 for i in range(90)]


def scheduler_connector(parallel: ParallelConfig, dp_rank: int, extra: dict[str, Any]) -> KVPlaneConnector:
    transfer = KVTransferConfig(kv_connector="KVPlaneConnector", kv_connector_module_path="kvplane.integrations.vllm",
                                kv_role="kv_producer", kv_connector_extra_config=extra, engine_id=f"p_dp{dp_rank}")
    vllm_config = SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel,
                                  cache_config=CacheConfig(block_size=BLOCK), instance_id="launch-1")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVPlaneConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def dp_prefills(dp_size: int, tp_size: int, extra: dict[str, Any], *, moe: bool = False) -> list[MiniEngine]:
    """One prefill engine (scheduler and TP workers) per DP rank of one host, as vLLM starts them."""
    engines: list[MiniEngine] = []
    try:
        for d in range(dp_size):
            engines.append(MiniEngine(extra, "kv_producer", tp_size=tp_size, engine_id=f"p_dp{d}",
                                      parallel=engine_parallel_config(dp_size, d, tp_size, moe=moe)))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_dp_ranks_on_one_host_listen_on_disjoint_ports_and_each_scheduler_advertises_its_own(moe: bool) -> None:
    dp_size, tp_size = 2, 2
    port = free_ports(dp_size * tp_size)
    engines = dp_prefills(dp_size, tp_size, {"disagg": {"mode": "pull", "port": port}}, moe=moe)
    try:
        bound = [[w._worker.prefill.port for w in engine.workers] for engine in engines]  # what each worker bound
        assert bound == [[port + d * tp_size + r for r in range(tp_size)] for d in range(dp_size)]
        for d, engine in enumerate(engines):
            done = engine.run(f"req-{d}", PROMPT, {"do_remote_decode": True})
            assert done.kv_transfer_params is not None
            params = TransferParams.from_dict(done.kv_transfer_params)
            assert [params.remote_port + r for r in range(params.tp_size)] == bound[d]  # what a decode reaches
    finally:
        for engine in engines:
            engine.shutdown()


def vllm_mooncake_port_function() -> Any:
    """``get_mooncake_side_channel_port`` from the installed vLLM's Mooncake connector, compiled alone: importing
    that module needs httpx/uvicorn, which the connector tests do not install."""
    import vllm
    import vllm.envs

    path = Path(vllm.__file__).parent / "distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py"
    if not path.exists():
        pytest.skip(f"this vLLM has no {path.name}")
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_mooncake_side_channel_port"]
    assert found, f"{path} no longer defines get_mooncake_side_channel_port: read how it spaces DP ranks now"
    namespace: dict[str, Any] = {"envs": vllm.envs, "VllmConfig": Any}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["get_mooncake_side_channel_port"]


def test_the_port_arithmetic_matches_vllms_own_mooncake_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Mooncake connector spaces DP ranks by tp_size from its bootstrap port; kvplane does the same."""
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998")  # vllm.envs reads the environment when asked
    theirs_of = vllm_mooncake_port_function()
    for d in range(3):
        parallel = engine_parallel_config(3, d, 4, moe=False)
        connector = scheduler_connector(parallel, d, {"disagg": {"mode": "pull", "port": 8998}})
        assert connector.config.disagg_for(0).base_port() == theirs_of(SimpleNamespace(parallel_config=parallel))
        connector.shutdown()


def test_the_scheduler_advertises_the_environments_host_and_port_over_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_ports(4)
    monkeypatch.setenv("KVPLANE_SIDE_CHANNEL_HOST", "127.0.0.9")
    monkeypatch.setenv("KVPLANE_SIDE_CHANNEL_PORT", str(port))
    engines = dp_prefills(2, 2, {"disagg": {"mode": "pull", "host": "127.0.0.2", "port": BASE}})
    try:
        done = engines[1].run("req-env", PROMPT, {"do_remote_decode": True})
        assert done.kv_transfer_params is not None
        assert (done.kv_transfer_params["remote_host"], done.kv_transfer_params["remote_port"]) == ("127.0.0.9",
                                                                                                    port + 2)
        for r, worker in enumerate(engines[1].workers):  # listening where the scheduler said, on that address
            assert worker._worker.prefill.port == port + 2 + r
            with socket.create_connection(("127.0.0.9", port + 2 + r), timeout=5):
                pass
    finally:
        for engine in engines:
            engine.shutdown()
