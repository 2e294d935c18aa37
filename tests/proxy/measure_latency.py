"""The proxy's added latency per request: the same request sent through ``kvplane proxy`` and straight to the
instances (the client then plays the proxy: the same legs, built by the same functions), interleaved, in one
run. Not a test: ``python tests/proxy/measure_latency.py [--reps N]`` (from the repository root, with the
worktree on PYTHONPATH). Prints per case the median and min of both and the difference.

Cases: ``stub`` (instances that answer at once, ``bad_server.py ok``: the proxy's own cost), and ``pull`` /
``push`` between two tiny-model engine processes with KV moved by Mooncake TE on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "disagg"), str(HERE.parent / "unit")]

import aiohttp  # noqa: E402
from proxyproc import Proc, spawn, start_engine  # noqa: E402

from kvplane.flows.disagg.wire.tokens import new_token  # noqa: E402
from kvplane.proxy import Instance, bodies  # noqa: E402

PROMPT = list(range(1, 60))
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_proxy(mode: str, prefill: str, decode: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvplane.cli.main", "proxy", "--port", str(port), "--mode", mode,
           "--prefill", prefill, "--decode", decode]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"


async def wait_up(client: aiohttp.ClientSession, url: str) -> None:
    for _ in range(600):
        try:
            async with client.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectorError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def direct(client: aiohttp.ClientSession, mode: str, p_inst: Instance, d_url: str) -> None:
    rid = uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    path = bodies.COMPLETIONS
    if mode == "pull":
        async with client.post(p_inst.url + path, json=bodies.prefill_body(BODY), headers=headers) as resp:
            params = (await resp.json())["kv_transfer_params"]
        async with client.post(d_url + path, json=bodies.decode_body(BODY, params), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        return
    token = new_token()

    async def leg(url: str, body: dict[str, Any]) -> None:
        async with client.post(url + path, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    await asyncio.gather(leg(p_inst.url, bodies.prefill_body(BODY, token)),
                         leg(d_url, bodies.decode_body(BODY, bodies.push_params(p_inst, path, rid, mode, token))))


async def proxied(client: aiohttp.ClientSession, url: str) -> None:
    async with client.post(url + bodies.COMPLETIONS, json=BODY, headers={"X-Request-Id": uuid.uuid4().hex}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def measure(mode: str, p_inst: Instance, d_url: str, proxy_url: str, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "proxy": []}
    async with aiohttp.ClientSession() as client:
        await wait_up(client, proxy_url)
        for i in range(reps + 5):
            order = ["direct", "proxy"] if i % 2 else ["proxy", "direct"]
            for kind in order:
                start = time.perf_counter()
                if kind == "direct":
                    await direct(client, mode, p_inst, d_url)
                else:
                    await proxied(client, proxy_url)
                if i >= 5:  # the first few warm connections, handshakes and caches
                    times[kind].append(time.perf_counter() - start)
    return times


def report(case: str, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    print(f"{case:<8} n={len(times['proxy']):<4} direct median {med['direct']:7.2f} ms min {low['direct']:7.2f} | "
          f"proxy median {med['proxy']:7.2f} ms min {low['proxy']:7.2f} | added median "
          f"{med['proxy'] - med['direct']:+6.2f} ms min {low['proxy'] - low['direct']:+6.2f} ms "
          f"(x{med['proxy'] / med['direct']:.2f})", flush=True)


def run_case(case: str, mode: str, prefill: Proc, decode_url: str, p_url: str, tmp: Path, reps: int) -> None:
    extra = "" if mode == "pull" else f",engine_id={prefill.ready['engine_id']},side_channel=127.0.0.1:" \
                                      f"{prefill.ready['side_port']}"
    p_inst = Instance.parse(p_url + extra, "prefill")
    proc, url = start_proxy(mode, p_url + extra, decode_url, tmp / f"proxy-{case}.log")
    try:
        report(case, asyncio.run(measure(mode, p_inst, decode_url, url, reps)))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--transport", default="mooncake")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="proxy-latency-"))
    stub = spawn("bad_server.py", ["ok", "ok2"], tmp, "stub")
    try:
        run_case("stub", "pull", stub, stub.url("ok2"), stub.url("ok"), tmp, args.reps)
    finally:
        stub.stop()
    for mode in ("pull", "push"):
        prefill = start_engine(tmp, "prefill", mode, args.transport, f"prefill-{mode}")
        decode = start_engine(tmp, "decode", mode, args.transport, f"decode-{mode}")
        try:
            run_case(mode, mode, prefill, decode.url(), prefill.url(), tmp, args.reps)
        finally:
            decode.stop()
            prefill.stop()


if __name__ == "__main__":
    main()
