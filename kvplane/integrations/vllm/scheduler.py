"""The scheduler-side half of the connector: decides what each step loads, stores, receives and sends.

Called by vLLM's scheduler, in this order per request: ``get_num_new_matched_tokens`` (a lookup in the
worker's host tier, "not yet" until its answer came, which the worker holds for the request until it loads,
ends or asks again: see ``lookup.py`` and ``holds.py``; or the token count a remote prefill holds), ``update_state_after_alloc``
(records the blocks), ``build_connector_meta`` once per step (hands the step's work to the workers),
``update_connector_output`` (what the workers finished), ``request_finished_all_groups`` (returns
``kv_transfer_params`` and keeps a prefill's blocks until the workers report them). No vLLM import here:
requests, blocks and scheduler outputs are read by attribute.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.tokens import is_token, new_token
from kvplane.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvplane.integrations.vllm.event_inbox import EventInbox
from kvplane.integrations.vllm.lookup import LookupClient, block_hash_int, lookup_address
from kvplane.integrations.vllm.metadata import (
    Groups,
    KVPlaneMetadata,
    Receive,
    Send,
    null_as_hole,
    real_blocks,
)
from kvplane.integrations.vllm.scheduler_book import Phase, SchedulerBook, Tracked

logger = logging.getLogger("kvplane.vllm")
NORMAL_FINISH = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)  # vLLM appends it to every external request id


class SchedulerSide:
    def __init__(
        self, config: ConnectorConfig, group_block_sizes: Sequence[int], hash_block_size: int, dp_rank: int = 0
    ) -> None:
        self.config = config
        self.block_sizes = {g: int(bs) for g, bs in enumerate(group_block_sizes)}
        self.hash_block_size = hash_block_size
        for g, bs in self.block_sizes.items():
            if bs % hash_block_size:
                raise ConnectorConfigError(
                    f"KV-cache group {g} has block_size={bs}, not a multiple of the prefix-hash block size "
                    f"{hash_block_size}; kvplane keys offloaded blocks by vLLM's chained block hashes"
                )
        self.step_tokens = math.lcm(*self.block_sizes.values())  # a load covers whole blocks in every group
        # vLLM maps failed block ids back to requests only with one group: with more, host-tier loads are
        # asynchronous, so that a failure can be reported by request like a failed receive
        self.loads_wait_in_vllm = len(self.block_sizes) > 1
        self.lookup = (
            LookupClient(lookup_address(config.engine_id, dp_rank), config.lookup_timeout_s)
            if config.offload is not None else None
        )
        self._book = SchedulerBook()  # one record per request, with its phase
        self._meta = KVPlaneMetadata()
        self._advertised: DisaggConfig | None = None  # rank 0 of this DP rank, built on the first send
        # with vLLM's KV events on (set by the connector): vLLM's event hash of a block hash, and the inbox
        self.event_hash: Callable[[Any], Any] | None = None
        self.events = EventInbox()

    # -- helpers ------------------------------------------------------------------------------------------
    def _hashes(self, request: Any, group: int) -> list[int]:
        """The request's chained block hashes at group ``group``'s block size (converted once, then extended)."""
        k = self.block_sizes[group] // self.hash_block_size
        known = self._book.get(request.request_id).hashes.setdefault(group, [])
        vllm_hashes = request.block_hashes
        for i in range(len(known) * k + k - 1, len(vllm_hashes), k):
            known.append(block_hash_int(vllm_hashes[i]))
        return known

    def _tags(self, request: Any, spans: dict[int, tuple[int, int]]) -> dict[int, list[Any]] | None:
        """With vLLM's KV events on: vLLM's event hash of each group's blocks ``a:b`` (those ``_hashes`` keys)."""
        if self.event_hash is None:
            return None
        k = {g: self.block_sizes[g] // self.hash_block_size for g in spans}
        return {g: [self.event_hash(request.block_hashes[(i + 1) * k[g] - 1]) for i in range(a, b)]
                for g, (a, b) in spans.items()}

    def _remote_prefill(self, request: Any) -> bool:
        params = request.kv_transfer_params
        return self.config.is_decode and bool(params) and bool(params.get("do_remote_prefill"))

    def transfer_id(self, request_id: str) -> str:
        """The id the decode side knows this request by: in push modes the proxy's (vLLM's suffix stripped)."""
        return RANDOM_SUFFIX.sub("", request_id) if self.config.mode != "pull" else request_id

    def _enter(self, request: Any, record: Tracked) -> None:
        """A remote prefill's ``kv_transfer_params``, parsed and checked once, where they enter (the first match
        call): ``record.params``, or ``record.refused`` saying why the receive cannot be this request's. vLLM's
        prefill returns the tokens it computed of the prompt (``remote_num_tokens = num_computed_tokens``, as its
        NixlConnector), and the decode gets the same prompt: params holding more tokens than the prompt has come
        from another prompt, whose first tokens' KV is not this prompt's."""
        if record.params is not None or record.refused:
            return
        record.params, record.refused = self._parse(request.kv_transfer_params)
        held, prompt = record.params.remote_num_tokens if record.params else 0, int(request.num_prompt_tokens)
        if held > prompt:
            record.refused = (
                f"kv_transfer_params.remote_num_tokens={held} but the request has {prompt} prompt tokens: the "
                f"prefill computed another, longer prompt, so its KV is not this request's; forward the "
                f"kv_transfer_params of this request's own prefill, unchanged (the prefill is told to free its blocks)")

    @staticmethod
    def _remote_tokens(request: Any, record: Tracked) -> int:
        """The prompt tokens a remote prefill holds: all of them where the params name none (or more than the
        prompt, or do not parse: such a receive fails on the worker, and vLLM's failure policy ends or recomputes
        it). Fewer than the prompt are a prefix: loaded, and the rest computed here."""
        prompt = int(request.num_prompt_tokens)
        held = record.params.remote_num_tokens if record.params is not None else 0
        return min(held, prompt) if held else prompt

    def _parse(self, params: dict[str, Any]) -> tuple[TransferParams | None, str]:
        """The request's ``kv_transfer_params``, parsed once for the receive route: its mode is this instance's
        unless the params name one. ``(None, why)`` when they do not parse."""
        try:
            return TransferParams.from_dict({"kvplane_mode": self.config.mode, **params}), ""
        except KvplaneError as e:
            return None, str(e)

    def _groups(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> Groups | None:
        """vLLM's per-group block ids, or None (logged) when they do not name one list per KV-cache group."""
        if len(block_ids) != len(self.block_sizes):
            logger.warning("kvplane: request %s came with block ids for %d KV-cache groups, the model has %d; "
                           "kvplane transfers nothing for it", request_id, len(block_ids), len(self.block_sizes))
            return None
        return {g: list(v) for g, v in enumerate(block_ids)}

    def _blocks_for(self, ids: Groups, num_tokens: int) -> Groups:
        """The blocks that hold a P/D request's ``num_tokens`` tokens, vLLM's null block as a ``HOLE`` (a sliding-
        window group's positions out of the window: nothing moves for them, on either side)."""
        return {g: null_as_hole(v[: -(-num_tokens // self.block_sizes[g])]) for g, v in ids.items()}

    # -- vLLM scheduler calls -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._remote_prefill(request):  # vLLM's prefix cache here holds num_computed_tokens: receive the rest
            record = self._book.get(request.request_id)
            self._enter(request, record)
            record.matched = num_computed_tokens
            count = self._remote_tokens(request, record) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if self.lookup is None:
            return 0, False
        # never the whole prompt: the last token is computed here to produce the first output
        limit = (request.num_prompt_tokens - 1) // self.step_tokens * self.step_tokens
        if not self.lookup.asked(request.request_id):
            if limit <= num_computed_tokens:
                return 0, False
            hashes = {g: self._hashes(request, g)[: limit // bs] for g, bs in self.block_sizes.items()}
            self.lookup.ask(request.request_id, hashes, self.block_sizes)
        answer = self.lookup.answer(request.request_id)
        if answer is None:
            return None, False  # not answered yet: vLLM asks again next step, the scheduler never waits
        record = self._book.get(request.request_id)
        if answer > 0:
            record.holds = True  # the worker holds the blocks until load, release or a new lookup
        hit = min(answer, limit) // self.step_tokens * self.step_tokens
        record.matched = num_computed_tokens
        # several KV-cache groups: vLLM takes a failed load only by request, and only while it waits for it
        return (hit - num_computed_tokens, self.loads_wait_in_vllm) if hit > num_computed_tokens else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        record = self._book.get(rid)
        record.request = request
        raw = blocks.get_block_ids()
        ids = self._groups(rid, raw) or {}
        if self._remote_prefill(request):
            params = request.kv_transfer_params
            params["do_remote_prefill"] = False  # asked once: a second allocation after the load adds blocks only
            local, record.matched = record.matched or 0, None  # vLLM's prefix cache held them: not received
            if num_external_tokens > 0:  # vLLM now waits for this receive: it must end, even if it cannot start
                self._enter(request, record)
                num_tokens = self._remote_tokens(request, record)
                typed, refused = (record.params, record.refused) if ids else \
                    (None, f"block ids for {len(raw)} KV-cache groups, the model has {len(self.block_sizes)}")
                if not ids:  # the worker fails it; vLLM's policy takes it from there
                    ids = {g: list(v) for g, v in enumerate(raw) if g in self.block_sizes}
                held = {g: min(local, num_tokens) // bs * bs for g, bs in self.block_sizes.items()}
                self._meta.receives.append(Receive(rid, typed, self._blocks_for(ids, num_tokens), num_tokens,
                                                   refused, held))
                self._receiving(rid, record)
            return
        loads = num_external_tokens > 0 and self.lookup is not None and bool(ids)
        if record.holds:  # the load below ends the hold on the worker; without one, release it
            record.holds = False
            if not loads:
                self._meta.released.append(rid)
        if loads:
            start, record.matched = record.matched or 0, None
            end = start + num_external_tokens
            span = {g: (start // bs, end // bs) for g, bs in self.block_sizes.items()}
            job = real_blocks(
                rid,
                {g: self._hashes(request, g)[a:b] for g, (a, b) in span.items()},
                {g: ids[g][a:b] for g, (a, b) in span.items()},
                self._tags(request, span),
            )
            job.num_tokens, job.wait_in_vllm = num_external_tokens, self.loads_wait_in_vllm
            self._meta.loads.append(job)
            if job.wait_in_vllm:
                self._receiving(rid, record)  # ends, fails and aborts like a receive

    def _receiving(self, rid: str, record: Tracked) -> None:
        """vLLM now waits for the request's KV. Only a request with nothing in flight gets there (a pushing one was
        preempted after its push started, which no proxy's one-token prefill allows): anything else is logged,
        never raised into vLLM's scheduler, and the request is left as it was."""
        if record.phase is Phase.TRACKED:
            self._book.to(rid, Phase.RECEIVING)
        else:
            logger.error("kvplane: request %s is queued to receive KV while %s; its receive is not tracked (a bug, "
                         "or a preempted layer-wise prefill)", rid, record.phase.value)

    def build_connector_meta(self, scheduler_output: Any) -> KVPlaneMetadata:
        if self.lookup is not None:  # ended requests whose lookup may have held blocks, once no hold can follow
            self._meta.released.extend(self.lookup.releasable())
        for req in scheduler_output.scheduled_new_reqs:
            record = self._book.get(req.req_id)
            record.block_ids, record.stored = {g: list(v) for g, v in enumerate(req.block_ids)}, {}
            self._after_step(req.req_id, req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new, record = cached.new_block_ids[i], self._book.get(rid)
            if rid in cached.resumed_req_ids:  # preempted and back: its blocks were replaced
                record.block_ids, record.stored = {g: list(v) for g, v in enumerate(new or ())}, {}
            elif new is not None:
                if record.block_ids is None:
                    record.block_ids = {}
                for g, v in enumerate(new):
                    record.block_ids.setdefault(g, []).extend(v)
            self._after_step(rid, cached.num_computed_tokens[i], scheduler_output)
        meta, self._meta = self._meta, KVPlaneMetadata()
        return meta

    def _after_step(self, rid: str, num_computed: int, scheduler_output: Any) -> None:
        record = self._book.get(rid)
        request, ids = record.request, record.block_ids
        if request is None or ids is None:
            return
        computed = num_computed + int(scheduler_output.num_scheduled_tokens.get(rid, 0))
        params = request.kv_transfer_params or {}
        if (self.config.is_prefill and self.config.mode == "layerwise" and params.get("do_remote_decode")
                and record.phase is Phase.TRACKED and computed >= request.num_prompt_tokens
                and (token := self._token(request, record)) is not None):
            self._book.to(rid, Phase.PUSHING)
            n = request.num_prompt_tokens
            self._meta.layerwise.append(Send(rid, self._blocks_for(ids, n), n, self.transfer_id(rid), token))
        if self.config.offload is None:
            return
        stored = record.stored
        hashes: Groups = {}
        block_ids: Groups = {}
        spans: dict[int, tuple[int, int]] = {}
        for g, bs in self.block_sizes.items():
            group_hashes = self._hashes(request, g)
            full = min(computed // bs, len(group_hashes), len(ids.get(g, ())))
            first = stored.get(g, 0)
            if full > first:
                hashes[g], block_ids[g], spans[g] = group_hashes[first:full], ids[g][first:full], (first, full)
                stored[g] = full
        if hashes:
            self._meta.stores.append(real_blocks(rid, hashes, block_ids, self._tags(request, spans)))

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' completions (vLLM frees a finished request's blocks on the first it sees), and KV events."""
        events = getattr(connector_output, "kv_cache_events", None)
        if events is not None and self.event_hash is not None:
            self.events.add(events.get_all_events(), int(getattr(connector_output, "expected_finished_count", 0)))
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid in getattr(worker_meta, "failed_receives", ()):
            self._restart_failed_receive(rid)
        for rid in connector_output.finished_sending or ():
            self._book.reported(rid, (Phase.SENDING, Phase.ABORTING))
        for rid in connector_output.finished_recving or ():
            # an aborting one ended before the abort reached the worker: nothing left to abort
            if self._book.reported(rid, (Phase.RECEIVING, Phase.ABORTING)) is Phase.ABORTING \
                    and rid in self._meta.aborts:
                self._meta.aborts.remove(rid)

    def _restart_failed_receive(self, rid: str) -> None:
        """A receive of a hybrid model failed on a vLLM that takes failures only as block ids (which it cannot
        map to a request when there are several KV-cache groups): the request recomputes its prompt."""
        record = self._book.records.get(rid)
        request = record.request if record is not None else None
        if request is None or record is None or record.phase is not Phase.RECEIVING:
            return
        request.num_computed_tokens = 0  # vLLM then treats the receive as done and schedules the whole prompt
        logger.warning(
            "kvplane: the KV of request %s failed to arrive; this vLLM cannot fail one request of a model with "
            "%d KV-cache groups, so it recomputes the prompt whatever kv_load_failure_policy says", rid,
            len(self.block_sizes),
        )

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        record = self._book.get(rid)
        if record.holds:
            self._meta.released.append(rid)
        if self.lookup is not None:
            self.lookup.abandon(rid)
        delay, out = self._request_finished(request, block_ids, record)
        self._book.finish(rid, delay)
        return delay is not None, out

    def _request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]], record: Tracked
    ) -> tuple[Phase | None, dict[str, Any] | None]:
        """Whether vLLM delays the free (the phase that waits for the workers' report), and the params."""
        rid = request.request_id
        if record.phase is Phase.RECEIVING:  # the KV is still arriving: free once nothing can write the blocks
            self._meta.aborts.append(rid)
            return Phase.ABORTING, None
        params = request.kv_transfer_params or {}
        if self.config.is_decode and params.get("do_remote_prefill") and params.get("remote_engine_id"):
            params["do_remote_prefill"] = False  # never allocated, so never received: the prefill frees it now
            self._enter(request, record)  # parsed already where the request was matched, if it was
            if record.params is not None:
                self._meta.declines.append(record.params)
            else:  # nothing names the prefill request: it frees at its lease's end
                logger.warning("kvplane: could not decline the receive of request %s: %s", rid, record.refused)
            return None, None
        if not (self.config.is_prefill and params.get("do_remote_decode")):
            return None, None
        if getattr(request.status, "name", str(request.status)) not in NORMAL_FINISH:
            if record.phase is Phase.PUSHING:  # layer-wise pushes may be under way: the worker drains them
                self._meta.aborts.append(rid)
                return Phase.SENDING, None
            return None, None
        num_tokens = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
        groups = self._groups(rid, block_ids)
        if groups is None:
            return None, None
        ids = self._blocks_for(groups, num_tokens)
        if num_tokens < 1 or not any(ids.values()):
            return None, None
        token = self._token(request, record)
        if token is None:
            return None, None
        self._meta.sends.append(Send(rid, ids, num_tokens, self.transfer_id(rid), token))
        return Phase.SENDING, self.transfer_params(self.transfer_id(rid), ids, num_tokens, token)

    def _token(self, request: Any, record: Tracked) -> str | None:
        """The request's token: the proxy's (push modes: it gave the decode the same), else drawn here once; None
        (logged once) when the client's ``kv_transfer_params`` carry one that is not a token: no decode can name
        the request then, so its KV is not held for one."""
        params = request.kv_transfer_params or {}
        token = params.get("kvplane_token")
        if not token:
            params["kvplane_token"] = token = new_token()
            request.kv_transfer_params = params
        if isinstance(token, str) and is_token(token):
            return token
        if not record.bad_token_logged:
            record.bad_token_logged = True
            logger.warning("kvplane: request %s has kv_transfer_params kvplane_token=%r, not 32 lowercase hex digits "
                           "(kvplane proxy draws it with kvplane.flows.disagg.wire.tokens.new_token()); its KV is not "
                           "held for a decode", request.request_id, token)
        return None

    def transfer_params(self, rid: str, ids: Groups, num_tokens: int, token: str = "") -> dict[str, Any]:
        """What ``PrefillSide.request_finished`` would return, built here where vLLM needs it (see docs/vllm.md):
        the advertised host and the base port of this scheduler's DP rank (its TP ranks listen from there)."""
        if self._advertised is None:
            self._advertised = self.config.disagg_for(0)
        return TransferParams.from_prefill(
            self._advertised, rid, [ids[g] for g in sorted(ids)], block_size=self.block_sizes[0],
            num_tokens=num_tokens, token=token,
        ).to_dict()

    def held_request_ids(self) -> dict[str, set[str]]:
        """Every per-request table, by name: all empty once every request has ended (the tests check it)."""
        return {**self._book.held(), "scheduler.lookups": self.lookup.pending() if self.lookup is not None else set()}

    def hit_source(self, request: Any) -> str:
        """Where the request's external tokens come from: ``p2p`` (a prefill instance) or ``host`` (the host
        tier; a store-tier hit is fetched through it)."""
        params = request.kv_transfer_params or {}
        return "p2p" if params.get("remote_engine_id") is not None else "host"

    def has_pending_block_frees(self) -> bool:
        """Frees that will come soon without the scheduler doing anything: aborted receives draining, pushes
        under way (a pull's blocks wait for the decode, up to the lease: not soon)."""
        return self._book.any_in(Phase.ABORTING) or \
            (self.config.mode in ("push", "layerwise") and self._book.any_in(Phase.SENDING))

    def has_pending_push_work(self) -> bool:
        return self.config.mode in ("push", "layerwise") and self._book.any_in(Phase.SENDING, Phase.ABORTING)

    def shutdown(self) -> None:
        if self.lookup is not None:
            self.lookup.close()

