"""Helpers of the proxy tests: engine and misbehaving-instance processes, and the proxy served in-process.

Processes write a ready file once serving; a process that dies first fails the test with its log's tail.
The proxy runs in the test's own event loop (``serve_proxy``) so tests can count its tasks and sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvplane.proxy import Instance, ProxyConfig, build_app
from kvplane.proxy.app import SERVING

HERE = Path(__file__).parent
STARTUP_S = 120.0
WAIT_S = 60.0
BEHAVIOURS = ("ok", "ok2", "slow", "fail", "reject", "garbage", "hang", "reset", "midstream", "trickle",
              "kvfail")


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    ready: dict[str, Any]
    log: Path

    def url(self, key: str = "http_port") -> str:
        return f"http://127.0.0.1:{self.ready[key]}"

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


def spawn(script: str, args: list[str], tmp: Path, name: str) -> Proc:
    (proc,) = spawn_all([(script, args, name)], tmp)
    return proc


def spawn_all(specs: list[tuple[str, list[str], str]], tmp: Path) -> list[Proc]:
    """Starts every ``(script, args, name)`` at once (their imports overlap), then waits until all serve; if one
    does not, all are stopped and the test fails with its log's tail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    started: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    for script, args, name in specs:
        ready, log = tmp / f"{name}.ready", tmp / f"{name}.log"
        with log.open("wb") as out:
            started.append((subprocess.Popen([sys.executable, str(HERE / script), "--ready", str(ready), *args],
                                             stdout=out, stderr=subprocess.STDOUT, env=env, cwd=HERE), ready, log))
    end = time.monotonic() + STARTUP_S
    for (script, args, _), (popen, ready, log) in zip(specs, started):
        while not ready.exists():  # written whole by a rename
            if popen.poll() is not None or time.monotonic() > end:
                for other, _, _ in started:
                    other.kill()
                    other.wait()
                raise AssertionError(f"{script} {args} did not start; log tail:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
    return [Proc(popen, json.loads(ready.read_text()), log) for popen, ready, log in started]


def engine_spec(role: str, mode: str, transport: str, name: str) -> tuple[str, list[str], str]:
    return "engine_server.py", ["--role", role, "--mode", mode, "--transport", transport,
                                "--engine-id", f"{name}-engine"], name


def start_engine(tmp: Path, role: str, mode: str, transport: str, name: str) -> Proc:
    (proc,) = spawn_all([engine_spec(role, mode, transport, name)], tmp)
    return proc


@asynccontextmanager
async def serve_proxy(config: ProxyConfig, shutdown_timeout: float = 5.0) -> AsyncIterator[tuple[str, web.Application]]:
    """The proxy app on a free port of 127.0.0.1, served as ``kvplane proxy`` serves it; its URL and app.
    Cleanup waits for in-flight requests up to ``shutdown_timeout`` s (as ``kvplane proxy`` does on SIGTERM)."""
    app = build_app(config)
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout, **SERVING)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Polls ``check`` until it holds; a condition not met within ``WAIT_S`` fails the test instead of hanging it."""
    end = asyncio.get_running_loop().time() + WAIT_S
    while not await check():
        assert asyncio.get_running_loop().time() < end, f"{what}: not within {WAIT_S:g} s"
        await asyncio.sleep(0.02)


async def until_metric(client: aiohttp.ClientSession, url: str, line: str) -> None:
    """Until the proxy at ``url`` shows ``line`` at ``/metrics``."""
    async def shown() -> bool:
        async with client.get(f"{url}/metrics") as resp:
            return line in await resp.text()

    await until(shown, f"{line!r} at {url}/metrics")


async def until_decode_up(client: aiohttp.ClientSession, url: str, decode: str, up: bool) -> None:
    """Until the proxy at ``url`` has the decode instance ``decode`` in rotation (``up``) or out of it."""
    async def seen() -> bool:
        async with client.get(f"{url}/health") as resp:
            return bool((await resp.json())["decode"][decode] is up)

    await until(seen, f"decode {decode} up={up} at {url}/health")


def socket_count(ports: set[int] | None = None) -> int:
    """Open sockets of this process (client and server side); with ``ports``, only TCP sockets whose local or
    remote port is one of them. Tests in the same pytest process leave threads of their own that open and close
    sockets at any time (a Mooncake Store client parked after its master went keeps reconnecting): a leak check
    counts the sockets of the servers it talks to, not theirs."""
    inodes = _tcp_inodes(ports) if ports is not None else None
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed while listing
            continue
        if link.startswith("socket:") and (inodes is None or link[8:-1] in inodes):
            count += 1
    return count


def _tcp_inodes(ports: set[int]) -> set[str]:
    """Inodes of this host's TCP sockets (IPv4 and IPv6) with a local or remote port in ``ports``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if int(local.rsplit(":", 1)[1], 16) in ports or int(remote.rsplit(":", 1)[1], 16) in ports:
                inodes.add(inode)
    return inodes


def instance(proc: Proc, kind: str, role: str, push: bool = False) -> Instance:
    """The ``Instance`` of one behaviour of ``bad_server.py``; push modes get a made-up side channel."""
    url = f"http://127.0.0.1:{proc.ready[kind]}"
    return Instance.parse(f"{url},engine_id=prefill-x,side_channel=127.0.0.1:5600" if push else url, role)
