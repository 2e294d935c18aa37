"""``kvplane proxy``: an OpenAI-compatible router in front of prefill and decode instances (P/D).

A client talks to the proxy as it would to one ``vllm serve``; the proxy sends each request to a prefill instance
and a decode instance with the ``kv_transfer_params`` that make kvplane move the KV between them, and streams the
decode's answer back. Built on aiohttp (server and client). The pieces, one idea each:

- ``config.py``: ``ProxyConfig`` and ``Instance`` (an instance's URL and, for push modes, its side channel);
- ``errors.py``: ``ProxyError``, an HTTP status, a cause label and a message, answered as a JSON body;
- ``pool.py``: instance selection (round-robin, least outstanding requests, kv-aware) over the healthy instances;
- ``health.py``: the ``GET /health`` checks that take an instance out and put it back;
- ``legs.py``: one HTTP call to an instance, with its timeout, mapped to ``ProxyError`` on every failure;
- ``bodies.py``: checking the client's request and building each leg's body;
- ``flows.py``: pull (prefill, then decode) and push / layer-wise (both at once);
- ``router.py`` (``--policy kv-aware``): the prefill holding most of the prompt, from ``kv_index.py`` (prefixes per
  instance and tier), ``kv_stream.py`` (whether an instance's event stream is in step), ``kv_events.py`` and
  ``kv_wire.py`` (the subscriber of vLLM's KV events), ``kv_cost.py`` (what a hit is worth) and ``prompt_ids.py``;
- ``metrics.py``: the Prometheus metrics; ``app.py``: the aiohttp application; ``cli.py``: the subcommand.

aiohttp and prometheus_client (the ``proxy`` extra) are imported by ``app.py`` only, when the proxy is built.
"""


from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplane.proxy.config import Instance, ProxyConfig

if TYPE_CHECKING:
    from kvplane.proxy.app import build_app

__all__ = ["Instance", "ProxyConfig", "build_app"]


def __getattr__(name: str) -> Any:
    # aiohttp and prometheus_client come with the `proxy` extra: `kvplane`'s other subcommands import this
    # package (for the proxy's flags) without them
    if name == "build_app":
        from kvplane.proxy.app import build_app

        return build_app
    raise AttributeError(f"module 'kvplane.proxy' has no attribute {name!r}")
