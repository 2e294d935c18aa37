"""The client side of the bench's serve rows: one streamed completion timed to its first content chunk and to
its end, and vLLM's prefix-cache reset (dev mode) retried until vLLM reports it done.

A request carries a fresh ``cache_salt`` unless the caller names one: vLLM's block hashes include it, so a
repeated prompt is computed again instead of hitting vLLM's own prefix cache, and kvplane's offload tiers, keyed
by those hashes, miss too.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from kvplane.bench.serve.procs import post
from kvplane.errors import KvplaneError

RESET_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Streamed:
    ttft_s: float  # request sent -> the first chunk with text
    e2e_s: float  # request sent -> the stream's end
    text: str
    prompt_tokens: int  # vLLM's usage (the stream's last chunk); 0 when it sent none


def salt() -> str:
    return uuid.uuid4().hex


def stream(base_url: str, model: str, prompt: str, max_tokens: int, cache_salt: str | None = None,
           timeout: float = 300.0, shared: bool = False) -> Streamed:
    """One greedy completion streamed from ``base_url`` (a vLLM instance or ``kvplane proxy``), under
    ``cache_salt`` (a fresh one when None); ``shared``: no salt, the prefix cache vLLM shares between requests."""
    url = urllib.parse.urlsplit(base_url)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if not shared:
        body["cache_salt"] = cache_salt or salt()
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", "accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise KvplaneError(f"{base_url}/v1/completions answered {resp.status}: "
                               f"{resp.read()[:500].decode(errors='replace')}")
        first, parts, tokens = 0.0, [], 0
        for raw in resp:  # SSE: one "data: {...}" line per event
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise KvplaneError(f"{base_url}/v1/completions streamed an error: {event['error']}")
            for choice in event.get("choices") or ():
                text = str(choice.get("text") or "")
                if text and not first:
                    first = time.perf_counter() - start
                parts.append(text)
            usage = event.get("usage") or {}
            tokens = int(usage.get("prompt_tokens") or tokens)
        end = time.perf_counter() - start
    finally:
        conn.close()
    return Streamed(first or end, end, "".join(parts), tokens)


def reset_prefix_cache(base_url: str) -> None:
    """Empty vLLM's own prefix cache (kvplane's tiers stay): vLLM refuses while blocks are held (a request
    running, an offload store in flight), so ask again until it reports success."""
    deadline = time.monotonic() + RESET_DEADLINE_S
    while True:
        code, answer = post(base_url + "/reset_prefix_cache", {})
        if code == 200 and answer.get("success", True):
            return
        if code != 200 or time.monotonic() > deadline:
            raise KvplaneError(f"POST {base_url}/reset_prefix_cache answered {code} {answer} (for "
                               f"{RESET_DEADLINE_S:.0f} s); the instance needs VLLM_SERVER_DEV_MODE=1 and no "
                               f"request in flight")
        time.sleep(0.05)
