"""``PrefillSide``: one prefill rank's end of disaggregation. It holds finished requests' blocks for decode
ranks to pull, or pushes them into blocks decode ranks registered, whole or layer by layer.

Who calls what (the engine's thread; the vLLM connector wraps these):

- ``request_finished(request_id, block_ids, num_tokens, token=None)`` once the request's KV is computed:
  returns the ``TransferParams`` a proxy forwards to decode (``.to_dict()``), carrying the request's token (drawn
  here for pull when none is given; push modes take the token the proxy gave both instances). The blocks are
  held from then on: under a lease that decode heartbeats renew (pull), or until they are pushed. The engine
  must not free them before ``get_finished`` reports the request.
- ``layerwise`` mode: ``start_request(request_id, block_ids, num_tokens, token=...)`` before the forward that
  completes the prompt, and ``save_layer(layer_name)`` after each attention layer has written its KV: that
  layer is written to every decode rank registered for the request while later layers compute.
- ``get_finished()`` each step: a ``Completion`` per request whose blocks kvplane released (``done``: every
  decode rank read or received them; ``failed``; ``timed_out``: the lease expired). It never waits on the loop.
- ``abort(request_id)``: a request aborted mid-prefill stops pushing; it is reported once its transfers drain.

Handshakes (``admission.py``), heartbeats and registrations run on this side's I/O loop thread; transfers on
its transfer thread (``mover.py``). Each request is a pure ``HeldRequest`` machine (``held_request.py``): this
side routes every engine call, message, transfer result and lease tick to it and carries out what it returns. A message about a request counts only from a decode rank that handshook
on that connection, with the request's token, from the decode instance that first used it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import ExitStack

import zmq

from kvplane.backend.base import Event
from kvplane.blocks.groups import Ids, PerGroup
from kvplane.flows.disagg.prefill.admission import Admission
from kvplane.flows.disagg.prefill.held_request import (
    Action,
    HeldRequest,
    Phase,
    Prepare,
    Registered,
    Release,
    Send,
    Terms,
    Write,
)
from kvplane.flows.disagg.prefill.pusher import Pusher, check_destination
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.auth import Guard, curve_keys
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.flows.disagg.wire.limits import EarlyRecords, PerPeer, RateLimit
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.loop import IOLoop
from kvplane.flows.disagg.wire.messages import (
    Cancel,
    Handshake,
    Heartbeat,
    Message,
    Problem,
    PushRegister,
    ReadDone,
)
from kvplane.flows.disagg.wire.mover import Mover
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.peers import PeerRecord, Prober
from kvplane.flows.disagg.wire.published import Published
from kvplane.flows.disagg.wire.results import Completion
from kvplane.flows.disagg.wire.routes import layers_by_source
from kvplane.flows.disagg.wire.side import SideLifecycle
from kvplane.flows.disagg.wire.tokens import request_token, same_token
from kvplane.kv.bound import BoundKV
from kvplane.metrics import recorder
from kvplane.metrics.watch import watch_side

logger = logging.getLogger("kvplane.disagg")
REMEMBERED = 10_000  # released request ids kept to answer late messages about them


class PrefillSide(SideLifecycle):
    def __init__(self, kv: BoundKV, config: DisaggConfig) -> None:
        if config.tp_size > 1 and not config.port:
            raise DisaggConfigError(
                f"DisaggConfig.port=0 with tp_size={config.tp_size}: decode finds prefill rank r at port + r, so a "
                f"TP prefill needs a fixed base port (e.g. port=5600: rank 0 on 5600, rank 1 on 5601)"
            )
        self.backend, self.spec, self.config = kv.backend, kv.spec, config
        self.local = LocalKV(kv, config, "prefill")
        self.counters = channel.Counters()
        self._warnings = RateLimit()  # log lines; replies have budgets of their own (limits.py)
        self._replies = PerPeer()  # Problem replies no token vouches for, per decode connection
        self._terms = Terms(config.rank, config.lease_s, config.push_timeout_s)
        self._held: dict[str, HeldRequest] = {}  # each request's machine, until it is released or dropped
        self._early = EarlyRecords()  # requests whose machine is EARLY: word the engine has not handed over yet
        self._released: OrderedDict[str, tuple[str, str]] = OrderedDict()  # request id -> (outcome, token)
        self._layer_events: list[tuple[str, Event]] = []
        self._next_lease_check = 0.0
        self._out = Published()
        self._engine_tokens: dict[str, str] = {}  # engine thread: handed over, not yet reported
        with ExitStack() as undo:  # a port in use, bad keys, a part that fails: give back what was built, raise
            undo.callback(self.local.close)
            self._loop = IOLoop(f"kvplane-prefill-{config.rank}", self._tick, self._publish)
            undo.callback(self._loop.context.destroy, linger=0)  # never started: close its sockets, end it
            self._guard = Guard(self._loop.context, curve_keys(config, "prefill"))
            undo.callback(self._guard.stop)
            self._socket, self.port = channel.router(self._loop.context, config.listen_host, config.rank_port(),
                                                     config.max_message_bytes, self._guard.server,
                                                     config.peer_timeout_s)
            self._mover = Mover(f"kvplane-prefill-{config.rank}-transfers", self.local.transport, "WRITE",
                                config.max_inflight, self._loop.submit, flow=config.mode)
            undo.callback(self._mover.stop)
            self._pusher = Pusher(self.local, self._mover)
            prober = Prober(self.local.transport, self._loop.submit, config.probe_timeout_s)
            self._admission = Admission(self.local, prober, self._reply, self._forget_peer, self._warnings)
            self._loop.watch(self._socket, self._on_readable)
            self._loop.start()  # last: nothing after it can fail, so a started loop is never undone
            undo.pop_all()
        watch_side(self, "prefill")

    @property
    def base_port(self) -> int:
        """The instance's base port, as ``TransferParams.remote_port`` carries it (this rank's port - rank)."""
        return self.port - self.config.rank

    # -- engine-facing ------------------------------------------------------------------------------------
    def request_finished(self, request_id: str, block_ids: PerGroup, num_tokens: int, *,
                         token: str | None = None) -> TransferParams:
        """Hold the request's blocks for decode and return the parameters to forward to it."""
        ids = self.local.block_ids(request_id, block_ids, num_tokens)
        token = self._token(request_id, token)
        self._loop.submit(lambda: self._on_handed(request_id, ids, num_tokens, token, finished=True))
        group0 = self.spec.group(self.local.group_ids[0])
        return TransferParams.from_prefill(
            self.config, request_id, [ids[g].tolist() for g in self.local.group_ids],
            block_size=group0.tokens_per_block, num_tokens=num_tokens, token=token, port=self.base_port,
            boot_id=self.local.boot_id,
        )

    def start_request(self, request_id: str, block_ids: PerGroup, num_tokens: int, *,
                      token: str | None = None) -> None:
        """Layer-wise push: the coming forward completes this request's prompt in these blocks."""
        ids = self.local.block_ids(request_id, block_ids, num_tokens)
        token = self._token(request_id, token)
        self._loop.submit(lambda: self._on_handed(request_id, ids, num_tokens, token, finished=False))

    def _token(self, request_id: str, token: str | None) -> str:
        token = request_token(request_id, token, self._engine_tokens.get(request_id), self.config.mode,
                              self.config.tp_size)
        self._engine_tokens[request_id] = token
        return token

    def save_layer(self, layer_name: str) -> None:
        """After ``layer_name`` wrote its KV: push it to registered decode ranks once the compute reaches here."""
        self.spec.layer(layer_name)
        event = self.backend.new_event()
        event.record(self.backend.current_stream())
        self._loop.submit(lambda: self._layer_events.append((layer_name, event)))

    def abort(self, request_id: str) -> None:
        self._loop.submit(lambda: self._on_abort(request_id))

    def get_finished(self, timeout_s: float = 10.0) -> list[Completion]:
        """Requests whose blocks kvplane released since the last call (free them now). Never waits on the I/O
        loop; ``timeout_s`` is accepted for older callers and unused."""
        out = self._out.drain()
        for c in out:
            self._engine_tokens.pop(c.request_id, None)
        return out

    def held_requests(self, timeout_s: float = 10.0) -> int:
        """Requests handed over (``request_finished``/``start_request``) and not yet reported by
        ``get_finished``: the engine must keep their blocks."""
        return len(self._engine_tokens)

    def push_registered(self, request_id: str) -> bool:
        """Whether a decode rank's push registration for ``request_id`` reached this rank (and the request is
        not released yet): the signal that a push can start as soon as the request is finished."""
        return request_id in self._out.registered

    # -- loop: carrying out the machines' actions (held_request.py) -----------------------------------------
    def _publish(self) -> None:
        self._out.publish(self._mover.moving)

    def _new(self, request_id: str, deadline: float, identity: bytes) -> HeldRequest:
        """A machine for word from ``identity`` about a request the engine has not handed over yet (``EARLY``)."""
        request = self._held[request_id] = HeldRequest(request_id, self._terms, deadline)
        self._early.add(request_id, identity)
        return request

    def _run(self, request: HeldRequest, actions: list[Action]) -> None:
        """Carry out what ``request``'s machine asked for, in order (a result may feed it the next event)."""
        if request.phase is not Phase.EARLY:
            self._early.discard(request.request_id)
        for action in actions:
            if isinstance(action, Send):  # the machine's Problems answer word its token did not vouch for
                if not isinstance(action.message, Problem) or self._replies.allow(action.to):
                    self._reply(action.to, action.message)
            elif isinstance(action, Prepare):
                assert request.held.block_ids is not None  # a machine prepares only once it has the blocks
                why = self._pusher.prepare(request.held.block_ids, action.target)
                if why:
                    self._run(request, request.plan_failed(action.target, why))
            elif isinstance(action, Write):
                self._write(request, action)
            elif isinstance(action, Registered):
                self._out.registered.add(request.request_id)
            elif isinstance(action, Release):
                self._release(request, action.completion)
            else:  # Drop: word of a request that never came here expired; nothing of the engine's is held
                self._forget(request)

    def _write(self, request: HeldRequest, write: Write) -> None:
        assert request.held.block_ids is not None  # a machine writes only once it has the blocks
        target = write.target
        self._pusher.write(request.held.block_ids, target, write.layers, write.whole,
                           lambda why: self._run(request, request.write_ended(target, why)))

    def _forget(self, request: HeldRequest) -> None:
        if self._held.get(request.request_id) is request:
            del self._held[request.request_id]
        self._out.registered.discard(request.request_id)

    def _release(self, request: HeldRequest, completion: Completion) -> None:
        self._forget(request)
        state, reason = completion.state, completion.reason
        self._released[request.request_id] = (f"{state}{': ' + reason if reason else ''}", request.token)
        while len(self._released) > REMEMBERED:
            self._released.popitem(last=False)
        if state != "done":
            self._warnings.warn(logger, "prefill rank %d: request %s %s%s", self.config.rank, request.request_id, state,
                             f" ({reason})" if reason else "")
        recorder().request_ended(self.config.mode, state)
        self._out.add(completion)

    # -- loop: engine events --------------------------------------------------------------------------------
    def _on_handed(self, request_id: str, ids: dict[int, Ids], num_tokens: int, token: str, finished: bool
                   ) -> None:
        request = self._held.get(request_id)
        if request is None:  # the engine's own word: the record leaves EARLY at once, below
            request = self._new(request_id, float("inf"), b"")
        if finished:
            self._run(request, request.finish(ids, num_tokens, token, time.monotonic()))
        else:
            self._run(request, request.start(ids, num_tokens, token))

    def _on_abort(self, request_id: str) -> None:
        request = self._held.get(request_id)
        if request is not None:
            self._run(request, request.abort())

    def _on_layer_saved(self, layer: str) -> None:
        for request in list(self._held.values()):
            self._run(request, request.layer_saved(layer))

    # -- loop: messages -------------------------------------------------------------------------------------
    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        self._receive(sock, True, self._dispatch)

    def _dispatch(self, identity: bytes, key: str, message: Message) -> None:
        if isinstance(message, Handshake):
            self._admission.on_handshake(identity, key, message)
            return
        if not isinstance(message, Heartbeat | ReadDone | PushRegister | Cancel):
            self._drop(f"{type(message).__name__} is not a message a prefill rank takes")
            return
        peer = self._admission.sender(identity, key, message.engine_id, message.rank)
        if peer is None:
            self._drop(f"{type(message).__name__} claims decode {message.engine_id!r} rank {message.rank}, which "
                       f"did not handshake on that connection (under that CURVE key)")
        elif isinstance(message, ReadDone | PushRegister) and message.tp_size != peer.tp_size:
            # the count of decode ranks the request waits for: only the one its handshake (manifest) showed
            self._drop(f"{type(message).__name__} for request {message.request_id} says tp_size={message.tp_size}, "
                       f"but decode {message.engine_id!r} rank {message.rank} handshook with tp_size={peer.tp_size}")
            self._problem(identity, message.request_id, f"{type(message).__name__}.tp_size={message.tp_size} differs "
                          f"from the tp_size={peer.tp_size} this rank handshook with; send the instance's TP size")
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(identity, message)
        elif isinstance(message, ReadDone):
            self._on_read_done(identity, message)
        elif isinstance(message, PushRegister):
            self._on_register(identity, peer, message)
        else:
            self._on_cancel(identity, message)

    def _on_heartbeat(self, identity: bytes, beat: Heartbeat) -> None:
        now, seen = time.monotonic(), set()
        for rid, token in beat.requests:
            if rid in seen:
                continue  # one answer per distinct request, however often it is named
            seen.add(rid)
            request = self._held.get(rid)
            if request is not None:
                self._run(request, request.heartbeat(beat.engine_id, token, now))
            elif rid in self._released and same_token(self._released[rid][1], token):
                self._problem(identity, rid, self._released[rid][0], vouched=True)

    def _on_read_done(self, identity: bytes, done: ReadDone) -> None:
        if done.expect_boot != self.local.boot_id:
            self._problem(identity, done.request_id, "stale: this prefill rank restarted")
            return
        request = self._held.get(done.request_id)
        if request is None:
            if done.request_id in self._released or not self._room_for_early(identity):
                return
            # vLLM gives the proxy kv_transfer_params a step before its worker calls request_finished here, so a
            # fast decode may be done reading first: keep its word (checked then) until the request comes
            request = self._new(done.request_id, time.monotonic() + self.config.lease_s, identity)
        self._run(request, request.read_done(identity, (done.engine_id, done.rank), done.ok, done.tp_size,
                                             done.token))

    def _on_register(self, identity: bytes, peer: PeerRecord, reg: PushRegister) -> None:
        rid = reg.request_id
        problem, vouched = "", False
        if reg.expect_boot != self.local.boot_id:
            problem = "stale: this prefill rank restarted; handshake again"
        elif rid in self._released and rid not in self._held:
            problem = f"request is no longer held ({self._released[rid][0]})"
            vouched = same_token(self._released[rid][1], reg.token)
        else:
            problem = check_destination(peer, reg)
        request = self._held.get(rid)
        if not problem and request is None and not self._room_for_early(identity):
            problem = "too many requests registered that this prefill rank was not handed yet; retry later"
        if problem:
            self._problem(identity, rid, problem, vouched)
            return
        if request is None:  # waiting for the request itself
            request = self._new(rid, time.monotonic() + self.config.push_timeout_s, identity)
        layers = layers_by_source(peer.manifest, self.config.tp_size, rid).get(self.config.rank, [])
        self._run(request, request.register(identity, peer, reg, layers))

    def _on_cancel(self, identity: bytes, cancel: Cancel) -> None:
        request = self._held.get(cancel.request_id)
        if request is None:  # a decode rank gave the push up before registering: judged once the request comes
            if cancel.request_id in self._released or not self._room_for_early(identity):
                return
            request = self._new(cancel.request_id, time.monotonic() + self.config.push_timeout_s, identity)
        self._run(request, request.cancel(identity, (cancel.engine_id, cancel.rank), cancel.token))

    def _room_for_early(self, identity: bytes) -> bool:
        """Whether word from ``identity`` may make another EARLY record (``limits.EarlyRecords``)."""
        why = self._early.refusal(identity)
        if why:
            self._drop(why)
        return not why

    def _drop(self, why: str) -> None:
        self.counters.rejected += 1
        self._warnings.warn(logger, "prefill rank %d: %s; dropped", self.config.rank, why)

    def _problem(self, identity: bytes, request_id: str, reason: str, vouched: bool = False) -> None:
        """Tell a decode connection a message about ``request_id`` was not acted on. ``vouched``: the message
        carried the request's token, so only its owner could earn the reply, and it is always sent (the decode
        would otherwise wait for its deadline); other replies spend the connection's own budget."""
        if vouched or self._replies.allow(identity):
            self._reply(identity, Problem(request_id, self.config.rank, reason))

    def _reply(self, identity: bytes, message: Message) -> bool:
        return channel.send(self._socket, message, self.counters, identity)

    # -- loop: peers and time -------------------------------------------------------------------------------
    def _forget_peer(self, peer: PeerRecord, why: str) -> None:
        for request in list(self._held.values()):
            self._run(request, request.peer_lost(peer, why))

    def _tick(self) -> float:
        while self._layer_events and self._layer_events[0][1].query():
            layer, _ = self._layer_events.pop(0)
            self._on_layer_saved(layer)
        now = time.monotonic()
        self._admission.prober.expire(now)
        if now >= self._next_lease_check:
            self._next_lease_check = now + min(0.05, self.config.lease_s / 10)
            for request in list(self._held.values()):
                actions = request.tick(now)
                if actions:
                    recorder().lease_expired()
                self._run(request, actions)
        return 0.0005 if self._layer_events else 0.05
