"""One HTTP call to one instance (a leg), bounded by its timeout, every failure a ``ProxyError``.

``call_prefill`` reads the whole answer and parses it; so does ``call_get`` (``GET /v1/models``). ``open_decode`` returns once the decode's answer has
started (its first bytes; the whole body when not streamed), so that a push flow can hold it until the prefill
has answered; the caller then streams the rest and closes it. A leg that is cancelled or fails closes its
connection, which makes vLLM abort the request on that instance.

Causes (the ``cause`` label and the error ``type``): ``<leg>_timeout`` (504), ``<leg>_unreachable`` (refused,
or not connected within ``--connect-timeout``), ``<leg>_disconnected``, ``<leg>_status`` (the instance answered
5xx; a 4xx goes back to the client with its own status), ``<leg>_bad_json`` (502).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvplane.proxy.config import Instance
from kvplane.proxy.errors import ProxyError

Unreachable = Callable[[Instance, str], None]
FIRST_EVENT_MAX = 1 << 16  # bytes of a stream held back at most while waiting for the end of its first event


def _failure(leg: str, inst: Instance, path: str, exc: BaseException, timeout_s: float,
             unreachable: Unreachable, connect_s: float = 0.0) -> ProxyError:
    where = f"{leg} {inst.url}{path}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # a host gone from the network: its SYNs go unanswered
        unreachable(inst, str(exc))
        return ProxyError(502, f"{leg}_unreachable", f"{where}: cannot connect within {connect_s:g} s "
                                                     f"(--connect-timeout); it is out of rotation until its "
                                                     f"GET /health answers again")
    if isinstance(exc, asyncio.TimeoutError):
        return ProxyError(504, f"{leg}_timeout", f"{where} did not answer within {timeout_s:g} s "
                                                 f"(--{leg}-timeout); the request was aborted there")
    if isinstance(exc, aiohttp.ClientConnectorError):
        unreachable(inst, str(exc))
        return ProxyError(502, f"{leg}_unreachable", f"{where}: cannot connect ({exc}); it is out of rotation "
                                                     f"until its GET /health answers again")
    return ProxyError(502, f"{leg}_disconnected", f"{where} closed the connection before answering "
                                                  f"({type(exc).__name__}: {exc})")


async def _status_error(leg: str, inst: Instance, path: str, resp: aiohttp.ClientResponse) -> ProxyError:
    text = (await resp.read())[:500].decode("utf-8", "replace")
    status = resp.status if 400 <= resp.status < 500 else 502
    return ProxyError(status, f"{leg}_status", f"{leg} {inst.url}{path} answered HTTP {resp.status}: {text}",
                      resp.status)


def first_event_error(first: bytes) -> int:
    """The ``code`` of a stream's first event when that event is complete and is ``data: {"error": {..., "code":
    N}}`` (vLLM fails a request whose stream has begun so: its status is 200 by then), else 0."""
    event, end, _ = first.replace(b"\r\n", b"\n").partition(b"\n\n")
    if not end:
        return 0
    data = b"\n".join(line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        parsed = json.loads(data)
    except ValueError:  # not JSON, not UTF-8
        return 0
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def parse_json(leg: str, inst: Instance, path: str, raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProxyError(502, f"{leg}_bad_json", f"{leg} {inst.url}{path} answered HTTP 200 with a body that is "
                                                 f"not JSON ({e}): {raw[:200]!r}") from None
    if not isinstance(data, dict):
        raise ProxyError(502, f"{leg}_bad_json", f"{leg} {inst.url}{path} answered a JSON "
                                                 f"{type(data).__name__}, not an object: {raw[:200]!r}")
    return data


async def call_prefill(session: aiohttp.ClientSession, inst: Instance, path: str, body: dict[str, Any],
                       headers: dict[str, str], timeout_s: float, connect_s: float,
                       unreachable: Unreachable) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_s)
    try:
        async with session.post(f"{inst.url}{path}", json=body, headers=headers | inst.headers,
                                timeout=timeout) as resp:
            if resp.status != 200:
                raise await _status_error("prefill", inst, path, resp)
            raw = await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure("prefill", inst, path, e, timeout_s, unreachable, connect_s) from None
    return parse_json("prefill", inst, path, raw)


async def call_get(session: aiohttp.ClientSession, inst: Instance, path: str, headers: dict[str, str],
                   timeout_s: float, connect_s: float, unreachable: Unreachable) -> bytes:
    """A GET whose answer is a JSON object (``/v1/models``), read whole and checked; failures are the
    ``<role>_*`` errors of the instance's leg."""
    leg = inst.role
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_s)
    try:
        async with session.get(f"{inst.url}{path}", headers=headers | inst.headers,
                                timeout=timeout) as resp:
            if resp.status != 200:
                raise await _status_error(leg, inst, path, resp)
            raw = await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure(leg, inst, path, e, timeout_s, unreachable, connect_s) from None
    parse_json(leg, inst, path, raw)
    return raw


@dataclass
class DecodeAnswer:
    inst: Instance
    path: str
    resp: aiohttp.ClientResponse
    first: bytes  # the whole body when not streamed
    streamed: bool
    timeout_s: float

    def close(self) -> None:
        self.resp.close()


async def open_decode(session: aiohttp.ClientSession, inst: Instance, path: str, body: dict[str, Any],
                      headers: dict[str, str], timeout_s: float, connect_s: float,
                      unreachable: Unreachable, whole_first_event: bool = False) -> DecodeAnswer:
    """``whole_first_event``: a stream's first bytes are read up to the end of its first event (at most
    ``FIRST_EVENT_MAX`` bytes), so that ``first_event_error`` can judge it before anything is passed on."""
    streamed = bool(body.get("stream"))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=timeout_s)
    try:
        resp = await session.post(f"{inst.url}{path}", json=body, headers=headers | inst.headers,
                                timeout=timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure("decode", inst, path, e, timeout_s, unreachable, connect_s) from None
    try:
        if resp.status != 200:
            raise await _status_error("decode", inst, path, resp)
        first = await resp.content.readany() if streamed else await resp.read()
        while streamed and whole_first_event and first and len(first) < FIRST_EVENT_MAX and \
                b"\n\n" not in first.replace(b"\r\n", b"\n"):
            more = await resp.content.readany()
            if not more:
                break
            first += more
        if not streamed:
            parse_json("decode", inst, path, first)
        return DecodeAnswer(inst, path, resp, first, streamed, timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        resp.close()
        raise _failure("decode", inst, path, e, timeout_s, unreachable, connect_s) from None
    except BaseException:
        resp.close()
        raise


async def rest_of_stream(answer: DecodeAnswer) -> AsyncIterator[bytes]:
    """The decode's remaining bytes, as they come (an async iterator)."""
    try:
        async for chunk in answer.resp.content.iter_any():
            yield chunk
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure("decode", answer.inst, answer.path, e, answer.timeout_s, lambda i, w: None) from None
