"""Both real transports (Mooncake TE, NIXL) against a peer rank in another process, on host memory.

The peer (``transport_peer.py``) holds seeded random bytes and answers with digests; this process builds
scattered plans, moves them, and checks bytes, notifications, typed errors, and that no failure hangs.
Each test runs once per engine; an engine that does not import here is skipped with its reason.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from framed import ChildDied, FramedProcess

from kvplane.backend import get_backend
from kvplane.backend.base import Backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import PeerUnreachable, PlanError, TransferFailed, TransferTimeout, TransportError
from kvplane.transports.base import PeerInfo, Transport, TransportConfig
from kvplane.transports.mooncake import MooncakeTransport
from kvplane.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration

TRANSPORTS: dict[str, type[Transport]] = {"mooncake": MooncakeTransport, "nixl": NixlTransport}
PEER_SCRIPT = Path(__file__).with_name("transport_peer.py")
KiB, MiB = 1 << 10, 1 << 20
SHARED_BYTES = 128 * MiB
PEER_SEED, LOCAL_SEED = 7, 8
ERROR_BOUND_S = 15.0  # a refused or unreachable transfer must end well within this
KILL_BOUND_S = 30.0  # a transfer whose peer was killed must end within this
KILL_BYTES, KILL_BLOCK = 512 * MiB, 256 * KiB
STARTUP_S = 90.0


class Peer(FramedProcess):
    """A ``transport_peer.py`` process and its framed msgpack channel; a silent peer fails the test."""

    def __init__(self, engine: str, nbytes: int, seed: int, log: Path) -> None:
        super().__init__([str(PEER_SCRIPT), engine, str(nbytes), str(seed)], log)
        hello = self.read(STARTUP_S)
        self.info = msgspec.msgpack.decode(hello["info"], type=PeerInfo)
        self.base, self.nbytes = int(hello["base"]), int(hello["nbytes"])

    def read(self, timeout: float = ERROR_BOUND_S) -> Any:
        try:
            return super().read(timeout)
        except ChildDied as e:
            pytest.fail(str(e))

    def ask(self, timeout: float = ERROR_BOUND_S, **message: Any) -> Any:
        self.send(**message)
        return self.read(timeout)

    def close(self, timeout: float = ERROR_BOUND_S) -> None:
        super().close(timeout)


@dataclass
class Rank:
    """This process's side: a transport, its registered host buffer, and the handle of the shared peer."""

    transport: Transport
    tensor: Any  # uint8 torch tensor from backend.alloc_host
    peer: str

    @property
    def base(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def buf(self) -> np.ndarray:
        return np.asarray(self.tensor.numpy())


def seeded_bytes(seed: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


def new_rank(engine: str, backend: Backend, nbytes: int, config: TransportConfig, peer: Peer) -> Rank:
    transport = TRANSPORTS[engine](backend, config)
    tensor = backend.alloc_host(nbytes)
    transport.register([(int(tensor.data_ptr()), nbytes)])
    handle = transport.connect(peer.info)
    peer.ask(cmd="connect", peer=msgspec.msgpack.encode(transport.peer_info()))
    return Rank(transport, tensor, handle)


@dataclass(frozen=True)
class Scatter:
    """Descriptors as offsets into the local and the remote buffer (never overlapping on either side)."""

    local: np.ndarray
    remote: np.ndarray
    length: np.ndarray

    def plan(self, op: str, local_base: int, remote_base: int) -> CopyPlan:
        local, remote = local_base + self.local, remote_base + self.remote
        return CopyPlan(local, remote, self.length) if op == "WRITE" else CopyPlan(remote, local, self.length)

    def ranges(self) -> Iterator[tuple[int, int, int]]:
        yield from zip(self.local.tolist(), self.remote.tolist(), self.length.tolist())


def scatter(seed: int, count: int, nbytes: int) -> Scatter:
    """``count`` blocks of 4 KiB..256 KiB (log-uniform, 4 KiB multiples), shuffled on the remote side."""
    rng = np.random.default_rng(seed)
    length = (np.exp2(rng.uniform(12, 18, count)).astype(np.int64) // (4 * KiB)).clip(1) * (4 * KiB)

    def packed(order: np.ndarray) -> np.ndarray:
        gaps = rng.integers(0, 4, count) * 4 * KiB
        starts = np.concatenate(([0], np.cumsum(length[order] + gaps[order])[:-1]))
        offsets = np.empty(count, dtype=np.int64)
        offsets[order] = starts
        return offsets

    local, remote = packed(np.arange(count)), packed(rng.permutation(count))
    if int((local + length).max()) > nbytes or int((remote + length).max()) > nbytes:
        raise ValueError(f"{count} blocks do not fit {nbytes} B; lower the count")
    return Scatter(local, remote, length)


# -- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(TRANSPORTS))
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    ok, why = TRANSPORTS[name].available()
    if not ok:
        pytest.skip(f"{name} is not usable here: {why}")
    return name


@pytest.fixture(scope="module")
def backend() -> Backend:
    return get_backend("cpu")


@pytest.fixture(scope="module")
def peer_initial() -> np.ndarray:
    return seeded_bytes(PEER_SEED, SHARED_BYTES)


@pytest.fixture(scope="module")
def local_initial() -> np.ndarray:
    return seeded_bytes(LOCAL_SEED, SHARED_BYTES)


@pytest.fixture(scope="module")
def shared_peer(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    peer = Peer(engine, SHARED_BYTES, PEER_SEED, tmp_path_factory.mktemp(engine) / "peer.log")
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def module_rank(engine: str, backend: Backend, shared_peer: Peer) -> Iterator[Rank]:
    rank = new_rank(engine, backend, SHARED_BYTES, TransportConfig(timeout_s=20.0), shared_peer)
    yield rank
    rank.transport.close()


@pytest.fixture(scope="module")
def chunked_rank(engine: str, backend: Backend, shared_peer: Peer) -> Iterator[Rank]:
    """A rank whose plans split into many engine calls (128 descriptors each), big enough for the kill test."""
    config = TransportConfig(timeout_s=20.0, max_batch=128)
    rank = new_rank(engine, backend, KILL_BYTES, config, shared_peer)
    yield rank
    rank.transport.close()


@pytest.fixture
def rank(module_rank: Rank, shared_peer: Peer, local_initial: np.ndarray) -> Rank:
    """The module's rank with both buffers back at their seeded bytes."""
    shared_peer.ask(cmd="reset")
    module_rank.buf[:] = local_initial
    return module_rank


def expected_after_write(peer_initial: np.ndarray, local: np.ndarray, moves: Scatter) -> str:
    expected = peer_initial.copy()
    for loff, roff, n in moves.ranges():
        expected[roff:roff + n] = local[loff:loff + n]
    return hashlib.sha256(expected.data).hexdigest()


def ends_within(bound_s: float, errors: tuple[type[Exception], ...], run: Any) -> Exception:
    """Run ``run()``; it must raise one of ``errors`` within ``bound_s`` seconds. Returns the error."""
    start = time.monotonic()
    with pytest.raises(errors) as caught:
        run()
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"{caught.value!r} took {elapsed:.1f} s, bound {bound_s} s"
    return caught.value


# -- bytes ----------------------------------------------------------------------------------------------
def test_read_of_scattered_blocks_copies_the_peers_bytes(rank: Rank, shared_peer: Peer,
                                                         peer_initial: np.ndarray) -> None:
    moves = scatter(seed=1, count=1100, nbytes=SHARED_BYTES)  # over 1024: Mooncake splits it in two
    rank.buf[:] = 0
    rank.transport.transfer(rank.peer, "READ", moves.plan("READ", rank.base, shared_peer.base))
    bad = [i for i, (loff, roff, n) in enumerate(moves.ranges())
           if not np.array_equal(rank.buf[loff:loff + n], peer_initial[roff:roff + n])]
    assert not bad, f"{len(bad)} of {len(moves.length)} blocks differ, first {bad[:5]}"


def test_write_of_scattered_blocks_lands_in_the_peers_memory(rank: Rank, shared_peer: Peer,
                                                             peer_initial: np.ndarray) -> None:
    moves = scatter(seed=2, count=1300, nbytes=SHARED_BYTES)
    rank.transport.transfer(rank.peer, "WRITE", moves.plan("WRITE", rank.base, shared_peer.base))
    assert shared_peer.ask(cmd="digest")["sha256"] == expected_after_write(peer_initial, rank.buf, moves)


def test_raw_move_the_benchs_baseline_copies_the_same_bytes(rank: Rank, shared_peer: Peer,
                                                            peer_initial: np.ndarray) -> None:
    moves = scatter(seed=3, count=1100, nbytes=SHARED_BYTES)  # over 1024: Mooncake's raw calls split it too
    rank.buf[:] = 0
    rank.transport.raw_move(rank.peer, "READ", moves.plan("READ", rank.base, shared_peer.base))
    bad = [i for i, (loff, roff, n) in enumerate(moves.ranges())
           if not np.array_equal(rank.buf[loff:loff + n], peer_initial[roff:roff + n])]
    assert not bad, f"{len(bad)} of {len(moves.length)} blocks differ, first {bad[:5]}"


def test_notify_reaches_the_peer_only_after_every_written_byte(chunked_rank: Rank, shared_peer: Peer,
                                                               peer_initial: np.ndarray,
                                                               local_initial: np.ndarray) -> None:
    shared_peer.ask(cmd="reset")
    chunked_rank.buf[:SHARED_BYTES] = local_initial
    moves = scatter(seed=3, count=1000, nbytes=SHARED_BYTES)  # 8 engine calls; the notify rides the last
    note = b"kv-ready:req-1\x00\xff"
    shared_peer.send(cmd="wait_notify", timeout=ERROR_BOUND_S)
    chunked_rank.transport.transfer(chunked_rank.peer, "WRITE",
                                    moves.plan("WRITE", chunked_rank.base, shared_peer.base), notify=note)
    seen = shared_peer.read()
    assert "error" not in seen, seen["error"]
    assert (seen["sender"], seen["msg"], seen["count"]) == (chunked_rank.transport.peer_info().name, note, 1)
    assert seen["sha256"] == expected_after_write(peer_initial, chunked_rank.buf, moves)


def test_call_when_done_wakes_a_poller_once_the_transfer_can_be_retired(rank: Rank, shared_peer: Peer,
                                                                      peer_initial: np.ndarray) -> None:
    """Mooncake's transfers end on a thread of their own and say so; NIXL's move only while polled, so they
    say they cannot and nothing is called. A wake registered after the end comes at once."""
    moves = scatter(seed=4, count=1100, nbytes=SHARED_BYTES)
    rank.buf[:] = 0
    woken = threading.Event()
    transfer = rank.transport.submit(rank.peer, "READ", moves.plan("READ", rank.base, shared_peer.base))
    tells = transfer.call_when_done(woken.set)
    transfer.wait(ERROR_BOUND_S)
    assert tells == isinstance(rank.transport, MooncakeTransport)
    if tells:
        assert woken.wait(ERROR_BOUND_S), "the transfer ended and never called the wake it was given"
        late = threading.Event()
        assert transfer.call_when_done(late.set) and late.is_set()
    else:
        assert not woken.is_set()
    bad = [i for i, (loff, roff, n) in enumerate(moves.ranges())
           if not np.array_equal(rank.buf[loff:loff + n], peer_initial[roff:roff + n])]
    assert not bad, f"{len(bad)} of {len(moves.length)} blocks differ, first {bad[:5]}"


# -- refusals -------------------------------------------------------------------------------------------
def test_address_outside_the_peers_published_spans_is_a_plan_error_before_submit(rank: Rank,
                                                                                  shared_peer: Peer) -> None:
    past_end = CopyPlan(np.array([shared_peer.base + shared_peer.nbytes], np.int64),
                        np.array([rank.base], np.int64), np.array([4 * KiB], np.int64))
    with pytest.raises(PlanError, match="remote"):
        rank.transport.submit(rank.peer, "READ", past_end)
    outside_local = CopyPlan(np.array([shared_peer.base], np.int64),
                             np.array([rank.base + SHARED_BYTES - KiB], np.int64), np.array([4 * KiB], np.int64))
    with pytest.raises(PlanError, match="local"):
        rank.transport.submit(rank.peer, "READ", outside_local)


def test_a_peer_that_withholds_its_spans_is_refused_before_the_engine_sees_a_plan(
        rank: Rank, shared_peer: Peer, peer_initial: np.ndarray) -> None:
    withheld = msgspec.structs.replace(shared_peer.info, spans=())
    handle = rank.transport.connect(withheld)
    try:
        inside = CopyPlan(np.array([shared_peer.base], np.int64), np.array([rank.base], np.int64),
                          np.array([4 * KiB], np.int64))
        with pytest.raises(PlanError, match="no registered memory"):  # no spans, no plan: nothing is unchecked
            rank.transport.submit(handle, "READ", inside)
    finally:
        rank.transport.connect(shared_peer.info)
    # the refusal leaves the connection usable
    moves = scatter(seed=4, count=64, nbytes=SHARED_BYTES)
    rank.transport.transfer(rank.peer, "READ", moves.plan("READ", rank.base, shared_peer.base))
    loff, roff, n = next(moves.ranges())
    assert np.array_equal(rank.buf[loff:loff + n], peer_initial[roff:roff + n])


def dead_peer_info(engine: str, backend: Backend) -> PeerInfo:
    """What a vanished rank published: nothing listens at its address any more."""
    if engine == "mooncake":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return PeerInfo(engine="mooncake", name=f"127.0.0.1:{port}", host="127.0.0.1", port=port,
                        spans=((1 << 40, 1 << 20),))  # it had published memory: the name is what is dead
    gone = TRANSPORTS[engine](backend)
    info = gone.peer_info()
    gone.close()
    return info


def test_unreachable_peer_is_a_typed_error_within_bound(engine: str, backend: Backend, rank: Rank,
                                                        shared_peer: Peer) -> None:
    dead = dead_peer_info(engine, backend)
    ends_within(ERROR_BOUND_S, (PeerUnreachable,), lambda: rank.transport.connect(dead))
    plan = CopyPlan(np.array([shared_peer.base], np.int64), np.array([rank.base], np.int64),
                    np.array([4 * KiB], np.int64))  # addresses are the live peer's: only the name is dead
    # a connect that failed left no spans for the name, so the plan is refused before the engine (PlanError);
    # an engine that still knew the name fails the transfer instead
    ends_within(ERROR_BOUND_S, (PeerUnreachable, TransferFailed, PlanError),
                lambda: rank.transport.submit(dead.name, "READ", plan).wait(ERROR_BOUND_S))


def test_peer_killed_mid_transfer_fails_typed_instead_of_hanging(engine: str, chunked_rank: Rank,
                                                                 tmp_path: Path) -> None:
    victim = Peer(engine, KILL_BYTES, -1, tmp_path / "victim.log")
    try:
        handle = chunked_rank.transport.connect(victim.info)
        count = KILL_BYTES // KILL_BLOCK  # 2048 blocks in 16 engine calls
        order = np.random.default_rng(5).permutation(count).astype(np.int64)
        plan = CopyPlan(victim.base + order * KILL_BLOCK, chunked_rank.base + np.arange(count) * KILL_BLOCK,
                        np.full(count, KILL_BLOCK, np.int64))
        transfer = chunked_rank.transport.submit(handle, "READ", plan)
        victim.kill()
        ends_within(KILL_BOUND_S, (TransferFailed, TransferTimeout), lambda: transfer.wait(KILL_BOUND_S))
        ends_within(ERROR_BOUND_S, (TransportError,),
                    lambda: chunked_rank.transport.submit(handle, "READ", plan).wait(ERROR_BOUND_S))
    finally:
        victim.close()


# -- lifecycle ------------------------------------------------------------------------------------------
def test_close_twice_is_fine_and_submit_after_close_raises(engine: str, backend: Backend,
                                                           shared_peer: Peer) -> None:
    transport = TRANSPORTS[engine](backend)
    tensor = backend.alloc_host(MiB)
    transport.register([(int(tensor.data_ptr()), MiB)])
    handle = transport.connect(shared_peer.info)
    transport.close()
    transport.close()
    plan = CopyPlan(np.array([shared_peer.base], np.int64), np.array([int(tensor.data_ptr())], np.int64),
                    np.array([4 * KiB], np.int64))
    with pytest.raises(TransportError, match="closed"):
        transport.submit(handle, "READ", plan)
    with pytest.raises(TransportError, match="closed"):
        transport.peer_info()
