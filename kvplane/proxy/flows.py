"""The two P/D flows, from a checked request to an opened decode answer.

- pull: the prefill computes the prompt (``max_tokens=1``, ``do_remote_decode``) and returns the
  ``kv_transfer_params`` that say where its KV is; the decode is then sent the request with them.
- push and layer-wise: both at once. The decode is told the prefill's engine id, side channel and request id
  before the prefill has run (``bodies.push_params``), and both get the same fresh ``kvplane_token``
  (``tokens.new_token``), so the prefill pushes only to that decode. The decode's answer is held until the
  prefill has answered: a decode that answers first is delivered only if the prefill then succeeds.

The caller leases the decode instance (``InstancePool.lease``) for the whole answer, streaming included, so
that least-outstanding selection counts it until the last byte. A prefill failure is answered as a ``ProxyError`` or, with ``--on-prefill-failure decode-only``, by sending the
request to the decode alone (outcome ``fallback``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvplane.flows.disagg.tokens import new_token
from kvplane.proxy import bodies
from kvplane.proxy.config import Instance, ProxyConfig
from kvplane.proxy.errors import ProxyError
from kvplane.proxy.legs import DecodeAnswer, Unreachable, call_prefill, open_decode
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool


@dataclass
class Route:
    config: ProxyConfig
    session: aiohttp.ClientSession
    prefill: InstancePool
    decode: InstancePool
    metrics: ProxyMetrics
    unreachable: Unreachable


async def _prefill(route: Route, inst: Instance, path: str, body: dict[str, Any],
                   headers: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    c = route.config
    route.metrics.instance_requests.labels(inst.role, inst.url).inc()
    try:
        return await call_prefill(route.session, inst, path, body, headers, c.prefill_timeout_s,
                                  c.connect_timeout_s, route.unreachable)
    finally:
        route.metrics.leg_seconds.labels("prefill").observe(time.perf_counter() - start)


async def _decode(route: Route, inst: Instance, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> DecodeAnswer:
    c = route.config
    route.metrics.instance_requests.labels(inst.role, inst.url).inc()
    return await open_decode(route.session, inst, path, body, headers, c.decode_timeout_s, c.connect_timeout_s,
                             route.unreachable)


def _returned_params(inst: Instance, path: str, answer: dict[str, Any]) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise ProxyError(502, "prefill_no_params",
                         f"prefill {inst.url}{path} answered without kv_transfer_params (got {params!r}); start it "
                         f"with kvplane's connector and kv_role kv_producer (docs/proxy.md)")
    return params


def _may_fall_back(route: Route, e: ProxyError) -> bool:
    """A prefill failure (none up included) the decode then serves alone, with ``--on-prefill-failure
    decode-only``; a 4xx is the client's mistake and goes back to it."""
    if route.config.on_prefill_failure != "decode-only" or e.status < 500:
        return False
    route.metrics.errors.labels(e.cause).inc()
    return True


async def pull(route: Route, d_inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
               ) -> tuple[DecodeAnswer, str]:
    try:
        with route.prefill.lease() as p_inst:
            answer = await _prefill(route, p_inst, path, bodies.prefill_body(body), headers)
            params: dict[str, Any] | None = _returned_params(p_inst, path, answer)
            outcome = "ok"
    except ProxyError as e:
        if not _may_fall_back(route, e):
            raise
        params, outcome = None, "fallback"
    return await _decode(route, d_inst, path, bodies.decode_body(body, params), headers), outcome


async def push(route: Route, d_inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str],
               request_id: str) -> tuple[DecodeAnswer, str]:
    token = new_token()
    with contextlib.ExitStack() as held:
        try:
            p_inst = held.enter_context(route.prefill.lease())
        except ProxyError as e:  # none up
            if not _may_fall_back(route, e):
                raise
            return await _decode(route, d_inst, path, bodies.decode_body(body, None), headers), "fallback"
        params = bodies.push_params(p_inst, path, request_id, route.config.mode, token)
        decoding = asyncio.ensure_future(_decode(route, d_inst, path, bodies.decode_body(body, params), headers))
        prefilling = asyncio.ensure_future(_prefill(route, p_inst, path, bodies.prefill_body(body, token), headers))
        try:
            await asyncio.wait({decoding, prefilling}, return_when=asyncio.FIRST_COMPLETED)
            if decoding.done() and not prefilling.done() and decoding.exception() is not None:
                raise decoding.exception()  # type: ignore[misc]  # the prefill's push has nowhere to go
            decode_first = decoding.done() and not prefilling.done()
            try:
                _returned_params(p_inst, path, await prefilling)
            except ProxyError as e:
                if decode_first:
                    e = ProxyError(e.status, e.cause, f"{e.message}; the decode {d_inst.url} had answered before "
                                                      f"the prefill, which then failed: its answer was dropped")
                if not _may_fall_back(route, e):
                    raise e from None
                await _cancel(decoding)
                return await _decode(route, d_inst, path, bodies.decode_body(body, None), headers), "fallback"
            return await decoding, "ok"
        except BaseException:
            await _cancel(decoding)
            await _cancel(prefilling)
            raise


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Stop a leg: its connection closes (vLLM aborts the request there); an opened decode answer is closed."""
    if not task.done():
        task.cancel()
    try:
        result = await task
    except BaseException:  # noqa: BLE001 - cancelled or failed: either way nothing is left open
        return
    if isinstance(result, DecodeAnswer):
        result.close()
