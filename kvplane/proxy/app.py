"""The aiohttp application: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and
``/metrics``.

Each request gets an ``X-Request-Id`` (the client's, or a fresh one), which both legs carry and the answer
repeats. A streamed answer is passed through from the decode as it comes (SSE); a failure after the first byte
ends the stream with an ``data: {"error": ...}`` event, as vLLM does. Every failure before it is a JSON error
body with the HTTP status of its ``ProxyError``. The app owns one client session (pooled connections), the
health-check task and, with ``--policy kv-aware``, the KV-event subscriber's thread; its cleanup closes them, and aiohttp's shutdown gives in-flight requests
``shutdown_timeout_s`` before cancelling them (cancelling a leg closes its connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
from aiohttp import web

from kvplane.proxy import bodies, flows
from kvplane.proxy.config import Instance, ProxyConfig
from kvplane.proxy.errors import ProxyError
from kvplane.proxy.health import record_unreachable, run_checks
from kvplane.proxy.legs import DecodeAnswer, call_get, rest_of_stream
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool
from kvplane.proxy.router import KvRouter

logger = logging.getLogger("kvplane.proxy")
FORWARDED = ("Authorization",)
# how the app is served (web.run_app / AppRunner): a client that leaves cancels its handler, which closes the
# legs' connections, so the instances abort the request instead of computing it for no one
SERVING: dict[str, Any] = {"handler_cancellation": True, "access_log": None}


class ProxyState:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill = InstancePool(config.prefill, config.policy, config.health_failures)
        self.decode = InstancePool(config.decode, config.policy, config.health_failures)
        self.session: aiohttp.ClientSession | None = None
        self.health: asyncio.Task[None] | None = None
        self.push_ids: set[str] = set()  # X-Request-Ids in flight (push modes)
        self.router = KvRouter.from_config(config, self.metrics)  # --policy kv-aware; started with the session
        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                self.metrics.instance_up.labels(inst.role, inst.name).set(1)

    @contextlib.contextmanager
    def naming(self, request_id: str) -> Iterator[None]:
        """Push modes name the prefill's request by the ``X-Request-Id`` (``bodies.transfer_id``): two in flight
        with one id would meet at the prefill, so the second is a 409."""
        if self.config.mode == "pull":
            yield
            return
        if request_id in self.push_ids:
            raise ProxyError(409, "duplicate_request_id",
                             f"X-Request-Id {request_id!r} is already in flight through this proxy; --mode "
                             f"{self.config.mode} names the prefill's request by it: send a unique id per request, "
                             f"or none (the proxy then draws one)")
        self.push_ids.add(request_id)
        try:
            yield
        finally:
            self.push_ids.discard(request_id)

    def route(self) -> flows.Route:
        if self.session is None:
            raise RuntimeError("the proxy app has not started: serve it with aiohttp (web.run_app / AppRunner)")

        def unreachable(inst: Instance, why: str) -> None:
            record_unreachable(self.prefill if inst.role == "prefill" else self.decode, self.metrics, inst, why)

        return flows.Route(self.config, self.session, self.prefill, self.decode, self.metrics, unreachable,
                           self.router)


STATE = web.AppKey("kvplane_proxy", ProxyState)


def build_app(config: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    app[STATE] = ProxyState(config)
    app.router.add_post(bodies.COMPLETIONS, _serve)
    app.router.add_post(bodies.CHAT, _serve)
    app.router.add_get(bodies.MODELS, _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.cleanup_ctx.append(_session)
    return app


async def _session(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    c = state.config
    state.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    state.health = asyncio.create_task(run_checks(state.session, [state.prefill, state.decode], state.metrics,
                                                  c.health_interval_s, c.health_timeout_s))
    if state.router is not None:
        state.router.start()
    try:
        yield
    finally:
        if state.router is not None:
            state.router.close()
        state.health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.health
        await state.session.close()


async def _health(request: web.Request) -> web.Response:
    """200 while at least one instance of each role is in rotation (passes its health checks); else 503 naming
    the roles with none (requests are still sent to them: ``InstancePool.pick``)."""
    state = request.app[STATE]
    missing = [role for role, pool in (("prefill", state.prefill), ("decode", state.decode)) if not any(pool.up.values())]
    return web.json_response({"status": "unhealthy" if missing else "ok", "missing": missing,
                              "mode": state.config.mode, "prefill": state.prefill.up, "decode": state.decode.up},
                             status=503 if missing else 200)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the list of a decode instance (the decode serves the model clients name), as it answered;
    OpenAI clients ask it first. Bounded by ``--decode-timeout``."""
    state = request.app[STATE]
    request_id, headers = _ids(request)
    c, route = state.config, state.route()
    try:
        with state.decode.lease() as inst:
            raw = await call_get(route.session, inst, bodies.MODELS, headers, c.decode_timeout_s,
                                 c.connect_timeout_s, route.unreachable)
    except ProxyError as e:
        return _error(state, bodies.MODELS, e, request_id)
    return web.Response(body=raw, content_type="application/json", headers={"X-Request-Id": request_id})


def _ids(request: web.Request) -> tuple[str, dict[str, str]]:
    """The request's ``X-Request-Id`` (the client's, or a fresh one) and the headers both legs carry."""
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return request_id, {"X-Request-Id": request_id, **{h: request.headers[h] for h in FORWARDED if h in request.headers}}


async def _serve(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    request_id, headers = _ids(request)
    path, mode = request.path, state.config.mode
    start = time.perf_counter()
    state.metrics.in_flight.inc()
    try:
        try:
            body = bodies.check_request(path, await _json(request), mode)
            with state.naming(request_id):
                answer, outcome = await flows.serve(state.route(), path, body, headers, request_id)
                try:  # the decode is leased until the answer's last byte: least-outstanding counts it
                    return await _respond(request, state, answer, path, outcome, request_id, start)
                finally:
                    answer.close()
                    state.decode.release(answer.inst)
        except ProxyError as e:
            return _error(state, path, e, request_id)
        except Exception as e:  # a bug of the proxy: still a JSON answer, and the traceback in the log
            return _error(state, path, _internal(e, request_id), request_id)
    finally:
        state.metrics.in_flight.dec()
        state.metrics.leg_seconds.labels("total").observe(time.perf_counter() - start)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProxyError(400, "bad_request", f"the request body is not JSON: {e}") from None
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].config.max_body_bytes
        raise ProxyError(413, "bad_request", f"the request body is over the proxy's limit of {limit} bytes "
                                             f"(ProxyConfig.max_body_bytes)") from None


def _internal(e: Exception, request_id: str) -> ProxyError:
    logger.exception("kvplane proxy: request %s failed inside the proxy", request_id)
    return ProxyError(500, "internal", f"the proxy failed: {type(e).__name__}: {e}")


def _count_error(state: ProxyState, path: str, e: ProxyError, request_id: str) -> None:
    state.metrics.errors.labels(e.cause).inc()
    state.metrics.requests.labels(path, state.config.mode, "error").inc()
    logger.warning("kvplane proxy: request %s: %s", request_id, e.message)


def _error(state: ProxyState, path: str, e: ProxyError, request_id: str) -> web.Response:
    _count_error(state, path, e, request_id)
    return web.json_response(e.body(request_id), status=e.status, headers={"X-Request-Id": request_id})


async def _respond(request: web.Request, state: ProxyState, answer: DecodeAnswer, path: str, outcome: str,
                   request_id: str, start: float) -> web.StreamResponse:
    headers = {"X-Request-Id": request_id}
    if not answer.streamed:
        state.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - start)
        state.metrics.requests.labels(path, state.config.mode, outcome).inc()
        return web.Response(body=answer.first, status=answer.resp.status, content_type="application/json",
                            headers=headers)
    out = web.StreamResponse(status=answer.resp.status, headers={
        **headers, "Content-Type": answer.resp.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache"})
    await out.prepare(request)
    try:
        await out.write(answer.first)
        try:
            async for chunk in rest_of_stream(answer):
                await out.write(chunk)
        except ConnectionResetError:
            raise
        except Exception as e:  # headers are sent: the error ends the stream, as vLLM's own errors do
            error = e if isinstance(e, ProxyError) else _internal(e, request_id)
            _count_error(state, path, error, request_id)
            await out.write(f"data: {json.dumps(error.body(request_id))}\n\n".encode())
            await out.write_eof()
            return out
        await out.write_eof()
    except ConnectionResetError:  # the client left: closing the decode leg aborts the request there
        state.metrics.errors.labels("client_disconnected").inc()
        state.metrics.requests.labels(path, state.config.mode, "error").inc()
        return out
    state.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - start)
    state.metrics.requests.labels(path, state.config.mode, outcome).inc()
    return out
