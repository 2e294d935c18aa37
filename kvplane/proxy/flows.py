"""The two P/D flows, from a checked request to an opened decode answer.

- pull: the prefill computes the prompt (``max_tokens=1``, ``do_remote_decode``) and returns the
  ``kv_transfer_params`` that say where its KV is; the decode is then sent the request with them.
- push and layer-wise: both at once. The decode is told the prefill's engine id, side channel and request id
  before the prefill has run (``bodies.push_params``), and both get the same fresh ``kvplane_token``
  (``tokens.new_token``), so the prefill pushes only to that decode. The decode's answer is held until the
  prefill has answered: a decode that answers first is delivered only if the prefill then succeeds.

With ``--policy kv-aware`` the prefill is picked by the router's plan (``router.py``): the prompt's token ids
(given, or from an instance's ``/tokenize``, ``prompt_ids.py``) looked up in each prefill's prefix index; the
prefill's answer then tells the router what it really found cached.

``serve`` runs the mode's flow on a decode instance it leases (``InstancePool.acquire``); the caller releases it
after the whole answer, streaming included, so that least-outstanding selection counts it until the last byte. A
prefill failure is answered as a ``ProxyError`` or, with ``--on-prefill-failure decode-only``, by sending the
request to the decode alone (outcome ``fallback``). A decode that answers a P/D request with a 5xx before anything
reached the client (``is_transfer_fault``: vLLM's answer when a KV load failed) is answered as a ``ProxyError`` or,
with ``--on-transfer-failure retry-plain``, by sending the client's request once more, without
``kv_transfer_params``, to a decode instance (another one while one is up; outcome ``retried``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvplane.flows.disagg.wire.tokens import new_token
from kvplane.proxy import bodies, prompt_ids
from kvplane.proxy.config import Instance, ProxyConfig
from kvplane.proxy.errors import ProxyError
from kvplane.proxy.legs import DecodeAnswer, Unreachable, call_prefill, first_event_error, open_decode
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool
from kvplane.proxy.router import KvRouter, Plan

logger = logging.getLogger("kvplane.proxy")


def is_transfer_fault(had_params: bool, status: int) -> bool:
    """Whether ``--on-transfer-failure retry-plain`` retries a decode's failure: a 5xx (its HTTP status, or the
    ``code`` of the error event its stream began with) to a request that carried ``kv_transfer_params``. vLLM
    answers so when the KV load failed under ``kv_load_failure_policy=fail``. A 4xx is the client's mistake, and a
    plain request (a decode-only fallback, or the retry itself) is not retried."""
    return had_params and 500 <= status < 600


class TransferFault(ProxyError):
    """The decode ``inst`` answered a P/D request with a 5xx before anything reached the client."""

    def __init__(self, e: ProxyError, inst: Instance) -> None:
        super().__init__(e.status, e.cause, e.message, e.instance_status)
        self.inst = inst


@dataclass
class Route:
    config: ProxyConfig
    session: aiohttp.ClientSession
    prefill: InstancePool
    decode: InstancePool
    metrics: ProxyMetrics
    unreachable: Unreachable
    router: KvRouter | None = None


async def kv_plan(route: Route, path: str, body: dict[str, Any], headers: dict[str, str]) -> Plan | None:
    """The router's plan for this request (None without ``--policy kv-aware``). The prompt is tokenized only while
    every stream is in step: else the pick is by load and the ids would serve nothing."""
    if route.router is None:
        return None
    if route.router.in_step() != "kv":
        return route.router.plan(None)
    pool = route.prefill
    inst = next((i for i in pool.instances if pool.up[i.name]), pool.instances[0])
    start = time.perf_counter()
    tokens = await prompt_ids.prompt_ids(route.session, inst, path, body, headers, route.config.connect_timeout_s)
    route.metrics.leg_seconds.labels("tokenize").observe(time.perf_counter() - start)
    return route.router.plan(tokens)


async def _prefill(route: Route, inst: Instance, path: str, body: dict[str, Any],
                   headers: dict[str, str], plan: Plan | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    c = route.config
    route.metrics.instance_requests.labels(inst.role, inst.name).inc()
    try:
        answer = await call_prefill(route.session, inst, path, body, headers, c.prefill_timeout_s,
                                    c.connect_timeout_s, route.unreachable)
        if route.router is not None:
            route.router.answered(inst.name, plan, answer)
        return answer
    except ProxyError as e:
        if e.status >= 500:  # the instance's failure, not the client's: it is now the most recently failed
            route.prefill.failed(inst)
        raise
    finally:
        route.metrics.leg_seconds.labels("prefill").observe(time.perf_counter() - start)


async def _decode(route: Route, inst: Instance, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> DecodeAnswer:
    """The opened answer; a P/D request's 5xx is a ``TransferFault``. With ``retry-plain`` a stream's first event
    is read whole and judged before anything is passed on."""
    c = route.config
    route.metrics.instance_requests.labels(inst.role, inst.name).inc()
    had_params = "kv_transfer_params" in body
    judged = had_params and c.on_transfer_failure == "retry-plain"
    try:
        answer = await open_decode(route.session, inst, path, body, headers, c.decode_timeout_s,
                                   c.connect_timeout_s, route.unreachable, whole_first_event=judged)
    except ProxyError as e:
        if e.status >= 500:
            route.decode.failed(inst)
        if is_transfer_fault(had_params, e.instance_status):
            raise TransferFault(e, inst) from None
        raise
    code = first_event_error(answer.first) if judged and answer.streamed else 0
    if is_transfer_fault(had_params, code):
        answer.close()
        route.decode.failed(inst)
        first = answer.first[:500].decode("utf-8", "replace").strip()
        raise TransferFault(ProxyError(502, "decode_status", f"decode {inst.url}{path} answered HTTP 200 with a "
                                                             f"stream whose first event is an error: {first}", code),
                            inst)
    return answer


async def serve(route: Route, path: str, body: dict[str, Any], headers: dict[str, str], request_id: str
                ) -> tuple[DecodeAnswer, str]:
    """The decode's opened answer to a checked request, and the outcome (``ok``, ``fallback``, ``retried``). The
    answer's instance (``answer.inst``) stays leased: the caller releases it (``route.decode.release``) after
    the answer's last byte."""
    plan = await kv_plan(route, path, body, headers)
    d_inst = route.decode.acquire()
    try:
        if route.config.mode == "pull":
            return await pull(route, d_inst, path, body, headers, plan)
        return await push(route, d_inst, path, body, headers, request_id, plan)
    except TransferFault as e:
        route.decode.release(d_inst)
        if route.config.on_transfer_failure != "retry-plain":
            raise
        fault = e
    except BaseException:
        route.decode.release(d_inst)
        raise
    return await _retry_plain(route, fault, path, body, headers, request_id)


async def _retry_plain(route: Route, fault: TransferFault, path: str, body: dict[str, Any], headers: dict[str, str],
                       request_id: str) -> tuple[DecodeAnswer, str]:
    """Once, on a decode instance other than the one that failed while another is up, the client's own body."""
    route.metrics.errors.labels(fault.cause).inc()
    route.metrics.transfer_retries.labels(path, route.config.mode).inc()
    inst = route.decode.acquire(avoid=fault.inst.name)
    logger.warning("kvplane proxy: request %s: %s; retrying it once on decode %s without kv_transfer_params "
                   "(--on-transfer-failure retry-plain)", request_id, fault.message, inst.url)
    try:
        answer = await _decode(route, inst, path, bodies.decode_body(body, None), headers)
    except ProxyError as e:
        route.decode.release(inst)
        raise ProxyError(e.status, e.cause, f"{e.message} (this was the retry without kv_transfer_params, after: "
                                            f"{fault.message})", e.instance_status) from None
    except BaseException:
        route.decode.release(inst)
        raise
    return answer, "retried"


def _returned_params(inst: Instance, path: str, answer: dict[str, Any]) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise ProxyError(502, "prefill_no_params",
                         f"prefill {inst.url}{path} answered without kv_transfer_params (got {params!r}); start it "
                         f"with kvplane's connector and kv_role kv_producer (docs/proxy.md)")
    return params


def _may_fall_back(route: Route, e: ProxyError) -> bool:
    """A prefill failure the decode then serves alone, with ``--on-prefill-failure
    decode-only``; a 4xx is the client's mistake and goes back to it."""
    if route.config.on_prefill_failure != "decode-only" or e.status < 500:
        return False
    route.metrics.errors.labels(e.cause).inc()
    return True


async def pull(route: Route, d_inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str],
               plan: Plan | None = None) -> tuple[DecodeAnswer, str]:
    try:
        with route.prefill.lease(scores=plan.scores if plan else None) as p_inst:
            answer = await _prefill(route, p_inst, path, bodies.prefill_body(body), headers, plan)
            params: dict[str, Any] | None = _returned_params(p_inst, path, answer)
            outcome = "ok"
    except ProxyError as e:
        if not _may_fall_back(route, e):
            raise
        params, outcome = None, "fallback"
    return await _decode(route, d_inst, path, bodies.decode_body(body, params), headers), outcome


async def push(route: Route, d_inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str],
               request_id: str, plan: Plan | None = None) -> tuple[DecodeAnswer, str]:
    token = new_token()
    with route.prefill.lease(scores=plan.scores if plan else None) as p_inst:
        params = bodies.push_params(p_inst, path, request_id, route.config.mode, token)
        decoding = asyncio.ensure_future(_decode(route, d_inst, path, bodies.decode_body(body, params), headers))
        prefilling = asyncio.ensure_future(_prefill(route, p_inst, path, bodies.prefill_body(body, token), headers,
                                                    plan))
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
