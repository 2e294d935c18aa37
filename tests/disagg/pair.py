"""In-process prefill and decode sides on bare caches, for the failure and load tests.

Both sides run in the test process with real transports on 127.0.0.1 (two engines, two ports) and talk over
real ZMQ sockets; ``Engine`` plays the engine around a side: a kvplane ``BlockPool`` hands out its blocks, and
they go back only when the side reports the request, so a leak shows as a pool that is not whole.
"""

from __future__ import annotations

import hashlib
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfill import fill
from kvref import split_choice

from kvplane.backend import get_backend
from kvplane.blocks.pool import BlockPool
from kvplane.flows.disagg import Completion, DecodeSide, DisaggConfig, PrefillSide, TransferParams
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

cpu = get_backend("cpu")
FAST = {"lease_s": 5.0, "heartbeat_s": 0.5, "transfer_timeout_s": 10.0, "handshake_timeout_s": 5.0,
        "push_timeout_s": 15.0, "drain_timeout_s": 5.0}


LONG: dict[str, Any] = {"lease_s": 600.0, "push_timeout_s": 600.0}  # nothing a test waits for expires


def until(what: str, done: Callable[[], bool], within_s: float = 20.0) -> None:
    """Wait for an event the code under test makes happen (never a guessed sleep); fail naming it."""
    end = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < end, what
        time.sleep(0.002)


def small_spec(block: int = 16, layers: int = 4) -> KVSpec:
    return KVSpec.gqa(layers, 4, 32, tokens_per_block=block, dtype="float32")


@dataclass
class Engine:
    """A side plus the block pool an engine would keep beside it."""

    side: Any
    spec: KVSpec
    cache: dict[str, Any]
    layout: str
    pool: BlockPool
    done: dict[str, Completion] = field(default_factory=dict)

    def allocate(self, tokens: int) -> list[int]:
        return self.pool.allocate(-(-tokens // self.spec.groups[0].tokens_per_block))

    def collect(self) -> dict[str, Completion]:
        for c in self.side.get_finished():
            assert c.request_id not in self.done, f"{c.request_id} reported twice"
            self.done[c.request_id] = c
        return self.done

    def wait(self, request_id: str, within_s: float = 30.0) -> Completion:
        end = time.monotonic() + within_s
        while request_id not in self.collect():
            if time.monotonic() > end:
                raise AssertionError(f"{request_id} not reported within {within_s} s")
            time.sleep(0.002)
        return self.done[request_id]

    @property
    def whole(self) -> bool:
        return self.pool.num_free == self.pool.num_blocks

    def close(self) -> None:
        self.side.close()


def make(role: str, spec: KVSpec, layout: str = "packed_kv", num_blocks: int = 64, seed: int = 0,
         engine: str = "mooncake", **config: Any) -> Engine:
    name, order = split_choice(layout)  # "packed_kv@HND": head-major blocks
    cache = allocate_cache(spec, name, num_blocks, order=order)
    if seed:
        fill(cache, seed)
    settings = {"engine_id": f"{role}-{uuid.uuid4().hex[:6]}", "transport": engine, **FAST, **config}
    cls = PrefillSide if role == "prefill" else DecodeSide
    side = cls(bind(cpu, spec, cache, name), DisaggConfig(**settings))
    return Engine(side, spec, cache, layout, BlockPool(num_blocks))


def token_for(request_id: str) -> str:
    """The token a test proxy gives both instances for ``request_id`` (push modes)."""
    return hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


def push_params(prefill_port: int, request_id: str, engine_id: str, tp: int = 1) -> TransferParams:
    """What a proxy tells a decode instance before the prefill has run (push mode); the prefill gets
    ``token=token_for(request_id)``."""
    return TransferParams.for_push(engine_id, request_id, "127.0.0.1", prefill_port, tp_size=tp,
                                   token=token_for(request_id))


def watched_local_kv() -> tuple[type, list[Any]]:
    """A ``LocalKV`` subclass (the real one and its transport) that counts its closes, and the list it appends
    each one built to: for the tests that a side failing at start gives back what it built."""
    from kvplane.flows.disagg.wire.local import LocalKV

    built: list[Any] = []

    class Watched(LocalKV):
        closes = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

        def close(self) -> None:
            self.closes += 1
            super().close()

    return Watched, built


def ready_prefill_ranks(decode: Engine) -> int:
    """How many prefill ranks ``decode``'s side has a ready connection to (handshaken, transport connected); read
    from the loop's records, for waiting until a handshake is done before acting on the request."""
    return sum(1 for conn in list(decode.side._conns.values()) if conn.ready)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive free ports: a TP-n prefill listens on base .. base + n - 1."""
    for _ in range(50):
        socks: list[socket.socket] = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((host, 0))
            base = first.getsockname()[1]
            for offset in range(1, count):
                extra = socket.socket()
                socks.append(extra)
                extra.bind((host, base + offset))
            return int(base)
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports on {host}")


def prefill_ranks(spec: KVSpec, layouts: list[str], seed: int = 0, **config: Any) -> list[Engine]:
    """One TP prefill instance in this process: a ``PrefillSide`` per layout in ``layouts`` (rank r uses
    ``layouts[r]``), sharing an engine id, a boot id and a base port; ``spec`` is one rank's share."""
    base, tp, boot = free_port_run(len(layouts)), len(layouts), uuid.uuid4().hex[:8]
    engine_id = f"prefill-{uuid.uuid4().hex[:6]}"
    ranks: list[Engine] = []
    try:
        for rank, layout in enumerate(layouts):
            ranks.append(make("prefill", spec, layout, seed=seed + rank if seed else 0, engine_id=engine_id,
                              boot_id=boot, rank=rank, tp_size=tp, port=base, **config))
    except BaseException:
        for made in ranks:
            made.close()
        raise
    return ranks
