"""Decode receives on the worker: starting one on the ``DecodeSide`` (a pull, or a push registration), declining
one vLLM dropped unstarted, and which KV-cache groups leave out the blocks vLLM's own prefix cache holds.

vLLM counts the prompt tokens its prefix cache holds as computed and asks the connector for the rest; the
scheduler side passes that count on (``Receive.local_tokens``, whole blocks of each group), and the decode side
moves only the blocks after it (``flows/disagg/wire/routes.py``). A group leaves its hit blocks out only where vLLM's
hit promises their KV is in them: a group vLLM caches by prefix hash (full attention; a sliding window, whose hit
holds the blocks of its window and vLLM's null block before). A group vLLM does not cache by hash
(``prefix_cacheable`` false) or whose hit it rebuilds by replaying its window (``prefix_replay_tokens``, vLLM
0.33's bounded replay of DeepSeek-V4 sliding-window MLA) has no KV there to trust: it is received whole, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvplane.errors import KvplaneError
from kvplane.flows.disagg import Completion, DecodeSide, TransferParams
from kvplane.integrations.vllm.metadata import Receive

logger = logging.getLogger("kvplane.vllm")


def skipping_groups(kv_cache_config: Any) -> frozenset[int]:
    """The KV-cache groups whose prefix-cache hits hold the hit tokens' KV (read by attribute: both vLLMs)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return frozenset(g for g, group in enumerate(groups) if _hit_holds_kv(group.kv_cache_spec))


def _hit_holds_kv(spec: Any) -> bool:
    return bool(getattr(spec, "prefix_cacheable", True)) and not getattr(spec, "prefix_replay_tokens", 0)


def start_receives(decode: DecodeSide | None, receives: Sequence[Receive], skipping: frozenset[int]
                   ) -> tuple[list[str], list[Completion]]:
    """Start each receive: the request ids started, and the failures to report for those that could not start."""
    started, failed = [], []
    for r in receives:
        if decode is None:
            raise KvplaneError(
                f"request {r.request_id!r} asks to receive KV but this instance has no decode side; set kv_role "
                f"to kv_consumer or kv_both and give kv_connector_extra_config a 'disagg' section"
            )
        failure = start_receive(decode, r, skipping)
        if failure is None:
            started.append(r.request_id)
        else:
            failed.append(failure)
    return started, failed


def start_receive(decode: DecodeSide, r: Receive, skipping: frozenset[int]) -> Completion | None:
    """Start ``r`` in its params' mode, leaving out the tokens vLLM holds in the groups of ``skipping``; the
    failure to report when it cannot start (vLLM's policy takes it), None when it started."""
    local = {g: n for g, n in r.local_tokens.items() if g in skipping and n > 0}
    try:
        if r.params is None:  # the scheduler half could not parse them: nothing names a prefill to tell
            raise KvplaneError(r.refused)
        if r.refused:  # params of another request: fail it by vLLM's policy, and let the prefill free now
            decline(decode, r.params)
            raise KvplaneError(r.refused)
        if r.params.kvplane_mode == "pull":
            decode.start_pull(r.request_id, r.params, r.block_ids, r.num_tokens, local)
        else:
            decode.register_push(r.request_id, r.params, r.block_ids, r.num_tokens, local)
        return None
    except KvplaneError as e:  # params that cannot be used: the request recomputes (or fails) by vLLM's policy
        logger.warning("kvplane: request %s cannot receive KV: %s", r.request_id, e)
        failed = {g: tuple(ids[local.get(g, 0) // _block_size(decode, g) :]) for g, ids in r.block_ids.items()}
        return Completion(r.request_id, "failed", failed, str(e))


def _block_size(decode: DecodeSide, group: int) -> int:
    groups = {g.group_id: g.tokens_per_block for g in decode.spec.groups}
    return groups.get(group, 1)


def decline(decode: DecodeSide | None, params: TransferParams) -> None:
    """A receive vLLM dropped before starting it (the client went away): the prefill frees its blocks now."""
    if decode is None:
        return
    try:
        decode.decline(params)
    except KvplaneError as e:  # params that name no request: the prefill frees it at its lease's end
        logger.warning("kvplane: could not decline the receive of prefill request %r: %s",
                       params.remote_request_id, e)


def finished_receives(decode: DecodeSide, receiving: Callable[[str], bool]) -> list[Completion]:
    """The decode side's completions for requests ``receiving`` says are awaited (started here and not reported
    yet); any other (a peer's stray or repeated one: vLLM asserts on ids it does not wait for) is logged and
    dropped."""
    out = []
    for c in decode.get_finished():
        if not receiving(c.request_id):
            logger.warning("kvplane: request %s is not being received here (unknown, or reported already): its "
                           "completion is dropped", c.request_id)
            continue
        out.append(c)
    return out
