"""Prefill and decode as two processes, each a miniature vLLM with the connector: pull, push, layer-wise
push, and a hybrid model with two KV-cache groups. The decode's KV must equal what it would have computed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from framed import FramedProcess  # noqa: E402
from ports import free_port  # noqa: E402

HERE = Path(__file__).parent
FAST = {"lease_s": 10.0, "heartbeat_s": 0.5, "transfer_timeout_s": 20.0, "handshake_timeout_s": 10.0,
        "push_timeout_s": 30.0, "drain_timeout_s": 5.0}


class Peer:
    def __init__(self, name: str, tmp: Path) -> None:
        self.proc = FramedProcess([str(HERE / "vllm_peer.py")], tmp / f"{name}.log",
                                  env={"PYTHONPATH": os.pathsep.join(
                                      p for p in (str(HERE), str(HERE.parent / "unit"), os.environ.get("PYTHONPATH")) if p)})

    def ask(self, timeout: float = 120.0, **message: Any) -> Any:
        reply = self.proc.ask(timeout, **message)
        assert "error" not in reply, f"{reply['error']}\n{self.proc.log_tail()}"
        return reply

    def read(self, timeout: float = 120.0) -> Any:
        reply = self.proc.read(timeout)
        assert "error" not in reply, f"{reply['error']}\n{self.proc.log_tail()}"
        return reply


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Peer, Peer]]:
    """Two processes for the whole module (each imports vLLM once); every test sets up fresh engines in them."""
    tmp = tmp_path_factory.mktemp("peers")
    prefill, decode = Peer("prefill", tmp), Peer("decode", tmp)
    try:
        yield prefill, decode
    finally:
        for peer in (prefill, decode):  # both are told first, so they wind down side by side
            if peer.proc.proc.poll() is None:
                try:
                    peer.proc.send(cmd="exit")
                except OSError:
                    pass
        prefill.proc.close()
        decode.proc.close()


@pytest.fixture
def pair(processes: tuple[Peer, Peer]) -> Iterator[tuple[Peer, Peer]]:
    yield processes
    for peer in processes:  # both tear down at once (a Mooncake side idles about 1 s as it closes), each answers
        peer.proc.send(cmd="teardown")
    for peer in processes:
        peer.read()


def setup(pair: tuple[Peer, Peer], mode: str, groups: list[list[int]], cross_layer: tuple[bool, bool] = (False, False)
          ) -> int:
    prefill, decode = pair
    port = free_port()
    disagg = {"mode": mode, "port": port, **FAST}
    prefill.proc.send(cmd="setup", extra={"disagg": disagg}, kv_role="kv_producer",
                      groups=groups, engine_id="prefill-0", cross_layer=cross_layer[0])
    decode.ask(cmd="setup", extra={"disagg": {"mode": mode, "port": free_port(), **FAST}}, kv_role="kv_consumer",
               groups=groups, engine_id="decode-0", cross_layer=cross_layer[1])
    assert "error" not in prefill.proc.read(120.0)
    return port


PROMPT = [(i * 37 + 11) % 997 for i in range(83)]  # 83 tokens: 5 full blocks of 16 and a partial one


@pytest.mark.integration
@pytest.mark.parametrize("groups", [[[2, 16]], [[2, 16], [1, 32]]], ids=["one-group", "hybrid-two-groups"])
def test_decode_pulls_the_prefill_kv_and_holds_what_it_would_have_computed(
    pair: tuple[Peer, Peer], groups: list[list[int]]
) -> None:
    prefill, decode = pair
    setup(pair, "pull", groups)
    done = prefill.ask(cmd="run", request_id="p-1", prompt=PROMPT, params={"do_remote_decode": True})
    params = done["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(PROMPT)
    assert len(params["remote_block_ids"]) == len(groups)
    decode.proc.send(cmd="run", request_id="d-1", prompt=PROMPT, params=params)
    prefill.ask(cmd="pump", request_id="p-1", within=5.0)  # freed once the decode has read, not at the 10 s lease
    received = decode.read()
    assert received["external_tokens"] == len(PROMPT) and received["computed_from"] == len(PROMPT) - 1
    assert not received["load_errors"]
    assert received["digest"] == decode.ask(cmd="reference", tokens=PROMPT, n=len(PROMPT))["digest"]
    assert received["digest"] == done["digest"]
    assert prefill.ask(cmd="whole")["whole"] and decode.ask(cmd="whole")["whole"]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["push", "layerwise"])
def test_prefill_pushes_into_blocks_the_decode_registered_first(pair: tuple[Peer, Peer], mode: str) -> None:
    prefill, decode = pair
    port = setup(pair, mode, [[2, 16]])
    proxy_params = {  # what a proxy sends the decode before the prefill has run
        "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "p-2",
        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1, "kvplane_mode": mode,
        "kvplane_token": "5" * 32,  # the proxy gives both instances the request's token
    }
    decode.proc.send(cmd="run", request_id="d-2-9f8e7d6c", prompt=PROMPT, params=proxy_params)
    # vLLM makes the proxy's id unique inside the engine: "p-2" arrives as "p-2-<8 hex>"
    done = prefill.ask(cmd="run", request_id="p-2-0a1b2c3d", prompt=PROMPT, params={"do_remote_decode": True,
                                                                                      "kvplane_token": "5" * 32})
    assert done["kv_transfer_params"]["kvplane_mode"] == mode
    assert done["kv_transfer_params"]["remote_request_id"] == "p-2"
    prefill.ask(cmd="pump", request_id="p-2-0a1b2c3d")
    received = decode.read()
    assert received["external_tokens"] == len(PROMPT) and not received["load_errors"]
    assert received["digest"] == done["digest"]
    assert prefill.ask(cmd="whole")["whole"] and decode.ask(cmd="whole")["whole"]


def test_a_decode_with_offload_keeps_pulled_kv_in_its_host_tier(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    port = free_port()
    prefill.proc.send(cmd="setup", extra={"disagg": {"mode": "pull", "port": port, **FAST}}, kv_role="kv_producer",
                      groups=[[2, 16]], engine_id="prefill-1")
    decode.ask(cmd="setup", extra={"disagg": {"mode": "pull", "port": free_port(), **FAST},
                                   "offload": {"host_bytes": 4 << 20, "pinned": False}},
               kv_role="kv_consumer", groups=[[2, 16]], engine_id="decode-1")
    assert "error" not in prefill.proc.read(120.0)
    done = prefill.ask(cmd="run", request_id="p-3", prompt=PROMPT, params={"do_remote_decode": True})
    decode.proc.send(cmd="run", request_id="d-3", prompt=PROMPT, params=done["kv_transfer_params"])
    prefill.ask(cmd="pump", request_id="p-3")
    assert decode.read()["digest"] == done["digest"]
    local = decode.ask(cmd="run", request_id="d-4", prompt=PROMPT)  # no proxy this time: the host tier has it
    assert local["external_tokens"] == 80 and local["digest"] == done["digest"]
    assert prefill.ask(cmd="whole")["whole"] and decode.ask(cmd="whole")["whole"]


@pytest.mark.integration
@pytest.mark.parametrize("cross_layer", [(True, True), (True, False), (False, True)],
                         ids=["cross-to-cross", "cross-to-per-layer", "per-layer-to-cross"])
def test_pull_between_cross_layer_and_per_layer_caches_lands_the_same_kv(
    pair: tuple[Peer, Peer], cross_layer: tuple[bool, bool]
) -> None:
    prefill, decode = pair
    setup(pair, "pull", [[2, 16]], cross_layer)
    done = prefill.ask(cmd="run", request_id="p-x", prompt=PROMPT, params={"do_remote_decode": True})
    decode.proc.send(cmd="run", request_id="d-x", prompt=PROMPT, params=done["kv_transfer_params"])
    prefill.ask(cmd="pump", request_id="p-x", within=5.0)
    received = decode.read()
    assert received["external_tokens"] == len(PROMPT) and not received["load_errors"]
    assert received["digest"] == decode.ask(cmd="reference", tokens=PROMPT, n=len(PROMPT))["digest"] == done["digest"]
    assert prefill.ask(cmd="whole")["whole"] and decode.ask(cmd="whole")["whole"]
