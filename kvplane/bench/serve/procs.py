"""Live server processes: `vllm serve` and `kvplane proxy` started as process groups, waited for, read and killed.

Each `Server` is one process group (`process_group=0`; `setpgrp` before Python 3.11), so `stop` and `kill` take
vLLM's engine-core and worker children with it. It stays in the caller's session: a session of its own is a
scheduler autogroup of its own (Linux `sched_autogroup`), an idle vLLM worker's `sched_yield` spin yields only
inside its group, and on 2 cores a 2P2D decode worker pinned beside another session's prefill worker got 0 ms of
CPU in 5 s (its side channel went silent, its handshake was never answered).

A server is ready when `GET /health` answers 200; `wait_ready` fails at once, with the log's tail, when the process
exits first. Its deadline is generous (a loaded 2-core machine starts a server in minutes, a quiet one in under
one): it only turns a hang into a failure. `metrics` reads `/metrics` into a flat dict and `delta` says what grew
between two readings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

READY_DEADLINE_S = 900.0
CONNECTOR = {"kv_connector": "KVPlaneConnector", "kv_connector_module_path": "kvplane.integrations.vllm"}
PROXY = [sys.executable, "-m", "kvplane.cli.main", "proxy"]
# a process group of its own in the caller's session (see above)
OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(role: str, extra: Mapping[str, Any], engine_id: str | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": dict(extra)}
    if engine_id:
        config["engine_id"] = engine_id
    return config


class Server:
    """One process group; `url` is where it answers HTTP."""

    def __init__(self, name: str, argv: list[str], url: str, log_dir: Path,
                 env: Mapping[str, str] | None = None, prefix: list[str] | None = None) -> None:
        self.name, self.url, self.log = name, url, log_dir / f"{name}.log"
        words = list(argv)
        child_env = {**os.environ, **(env or {})}
        while words and re.match(r"^[A-Z_]+=", words[0]):
            key, _, value = words.pop(0).partition("=")
            child_env[key] = value
        self.argv = [*(prefix or []), *words]
        self.started = time.monotonic()
        self.ready_s = 0.0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                         cwd=log_dir, **OWN_GROUP)

    def tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, after its first traceback (where vLLM's "see root cause above" points) when
        that one lies further up."""
        text = self.log.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(text) if "Traceback (most recent call last)" in line), None)
        cause = text[first : first + lines] + ["..."] if first is not None and first < len(text) - lines else []
        return "\n".join(cause + text[-lines:])

    def wait_ready(self) -> float:
        """Seconds from start to the first 200 on /health."""
        while time.monotonic() - self.started < READY_DEADLINE_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before it was ready:\n{self.tail()}")
            if status(self.url + "/health") == 200:
                self.ready_s = time.monotonic() - self.started
                return self.ready_s
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {READY_DEADLINE_S} s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # vLLM's children, whatever the parent did
        self.proc.wait(timeout=60)


def start_all(servers: list[Server]) -> dict[str, float]:
    """Wait for servers started side by side; their start times by name."""
    try:
        return {s.name: s.wait_ready() for s in servers}
    except BaseException:
        for s in servers:
            s.stop()
        raise


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return 0


def post(url: str, body: Mapping[str, Any], timeout: float = 300.0,
         headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON answer) of a POST; an HTTP error's JSON body is returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), json.load(r)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return int(e.code), json.loads(raw)
        except ValueError:
            return int(e.code), {"raw": raw.decode(errors="replace")}


def metrics(url: str) -> dict[str, float]:
    """`/metrics` as {'name{label="v",...}': value}, labels sorted, vLLM's `engine` and `model_name` dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: Mapping[str, float], before: Mapping[str, float], prefix: str) -> dict[str, float]:
    """What grew between two `metrics` readings, for the keys starting with `prefix`."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.startswith(prefix) and v - before.get(k, 0.0) != 0}
