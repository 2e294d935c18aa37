"""The client's request, checked, and the body each leg gets.

The prefill leg computes the prompt and one token: ``max_tokens=1``, ``n=1``, not streamed, with
``kv_transfer_params={"do_remote_decode": true}`` (push modes add the request's ``kvplane_token``). The decode
leg is the client's request with the ``kv_transfer_params`` that point it at the prefill's KV.

Push modes name the prefill's request before it exists, by the id vLLM gives it inside the engine: the
OpenAI server makes it ``cmpl-<X-Request-Id>-<prompt index>`` (completions) or ``chatcmpl-<X-Request-Id>``
(chat; ``vllm/entrypoints/openai/*/serving.py`` in 0.27.1 and 0.33.0), the engine appends ``-<8 hex>``, and
kvplane's prefill strips that again (``SchedulerSide.transfer_id``). So a push request carries one prompt; so
does a pull request, because vLLM's completions answer carries the first prompt's ``kv_transfer_params`` only.
Every mode serves ``n=1``: a prefill request's KV is received once, and vLLM's decode splits ``n`` into child
requests that would share one ``kv_transfer_params``, so a client sends ``n`` requests instead (each gets its own
prefill, and the proxy may spread them over decode instances).
"""

from __future__ import annotations

import copy
from typing import Any

from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.proxy.config import Instance
from kvplane.proxy.errors import ProxyError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODELS = "/v1/models"  # GET: a decode instance's list, passed through


def check_request(path: str, body: Any, mode: str) -> dict[str, Any]:
    """The client's JSON body, or a 400 ``ProxyError`` naming the field that is missing or wrong."""
    if not isinstance(body, dict):
        raise ProxyError(400, "bad_request", f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError(400, "bad_request", f"'model' is {model!r}; give the served model's name")
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ProxyError(400, "bad_request", f"'messages' is {_short(messages)}; give a non-empty list of "
                                                 f"{{'role': ..., 'content': ...}}")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ProxyError(400, "bad_request", f"'prompt' is {_short(prompt)}; give a string or a list of "
                                                 f"token ids")
        several = isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)
        if several:  # a list of token ids, or of one prompt, is one prompt
            raise ProxyError(400, "bad_request", f"--mode {mode} serves one prompt per request; 'prompt' is a "
                                                 f"list of {len(prompt)} prompts: send them one by one "
                                                 f"(vLLM answers the first prompt's kv_transfer_params only)")
    n = body.get("n", 1)
    if n != 1:  # pull too: vLLM's n child requests would all receive the one prefill request's KV
        again = f"send {n} requests with n=1" if isinstance(n, int) and not isinstance(n, bool) and n > 1 \
            else "leave it out or give n=1"
        raise ProxyError(400, "bad_request", f"'n' is {n!r}; --mode {mode} serves n=1: one prefill request holds "
                                             f"one copy of the prompt's KV, which one decode request receives; "
                                             f"{again} (each gets its own prefill)")
    return body


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def transfer_id(path: str, request_id: str) -> str:
    """The id kvplane's prefill knows the request by, for a prefill request sent with ``X-Request-Id``."""
    return f"chatcmpl-{request_id}" if path == CHAT else f"cmpl-{request_id}-0"


def prefill_body(body: dict[str, Any], token: str = "") -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1  # one copy of the prompt's KV: with n > 1 the prefill would hold n, and the decode pull one
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    params: dict[str, Any] = {"do_remote_decode": True}
    if token:
        params["kvplane_token"] = token
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(body)
    if params is None:
        out.pop("kv_transfer_params", None)  # decode-only: the decode computes the prompt itself
    else:
        out["kv_transfer_params"] = params
    return out


def push_params(prefill: Instance, path: str, request_id: str, mode: str, token: str) -> dict[str, Any]:
    """What the decode is told before the prefill ran: kvplane's ``TransferParams.for_push``, as it is."""
    return TransferParams.for_push(prefill.engine_id, transfer_id(path, request_id), prefill.side_host,
                                   prefill.side_port, tp_size=prefill.tp_size, mode=mode,  # type: ignore[arg-type]
                                   token=token).to_dict()
