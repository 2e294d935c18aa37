"""A request's prompt as token ids, for ``--policy kv-aware`` to look up: given in the request, or asked of an
instance's ``POST /tokenize``.

A completions ``prompt`` of token ids is used as it is. Otherwise the proxy asks vLLM's ``/tokenize``
(``vllm/entrypoints/serve/tokenize/protocol.py``): ``TokenizeCompletionRequest`` ``{model, prompt: str,
add_special_tokens (default true)}`` for completions, ``TokenizeChatRequest`` ``{model, messages,
add_generation_prompt (default true), continue_final_message, add_special_tokens (default false), chat_template,
chat_template_kwargs, tools, mm_processor_kwargs}`` for chat, with the client's own values of those fields; the
answer is ``TokenizeResponse`` ``{count, max_model_len, tokens}``. Every instance serves one model, so any one
tokenizes for all. A failure (no answer within ``TOKENIZE_TIMEOUT_S``, an error, a body without ``tokens``) is no
request's failure: the router serves that request by load, and the first failure is logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from kvplane.proxy import bodies
from kvplane.proxy.config import Instance

logger = logging.getLogger("kvplane.proxy")
TOKENIZE_TIMEOUT_S = 5.0
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "tools", "mm_processor_kwargs")
_logged: set[str] = set()


def given(path: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids a completions request carries (``prompt`` a list of ints, or one such list), else None."""
    if path != bodies.COMPLETIONS:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    if path == bodies.CHAT:
        return {"model": body.get("model"), **{k: body[k] for k in CHAT_FIELDS if k in body}}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    return {"model": body.get("model"), "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}


async def prompt_ids(session: aiohttp.ClientSession, inst: Instance, path: str, body: dict[str, Any],
                     headers: dict[str, str], connect_s: float) -> list[int] | None:
    ids = given(path, body)
    if ids is not None:
        return ids
    ask = tokenize_body(path, body)
    if ask is None:
        return None
    timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S, sock_connect=connect_s)
    try:
        async with session.post(f"{inst.url}/tokenize", json=ask, headers=headers, timeout=timeout) as resp:
            answer = await resp.json(content_type=None) if resp.status == 200 else None
            why = f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        answer, why = None, f"{type(e).__name__}: {e}"
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
        return tokens
    level = logging.DEBUG if inst.url in _logged else logging.WARNING
    _logged.add(inst.url)
    logger.log(level, "kvplane proxy: %s/tokenize gave no token ids (%s): requests are routed by load until it "
                      "does", inst.url, why if answer is None else "no 'tokens' list in its answer")
    return None
