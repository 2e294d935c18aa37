"""The offload engine's store tier against a real ``mooncake_master`` on loopback (cpu backend, tcp).

Blocks the host tier evicts (or writes through) land in Mooncake Store, and a lookup that misses the host finds
them there and loads the same bytes; two engines in different processes share a prefix through one store; a
master killed mid-run costs no request more than the bound, leaks no host block, and the host tier carries on.
The stand-in versions of the bounds live in ``tests/unit/test_offload_store_tier.py``.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from pathlib import Path

import pytest
import torch
from framed import FramedProcess
from offload_fakes import Harness, small_spec

from kvplane.blocks import block_hashes
from kvplane.flows.offload import MasterError, MooncakeMaster, StoreConfig, start_master
from kvplane.flows.offload.store import StoreTier

pytestmark = pytest.mark.integration

PEER_SCRIPT = Path(__file__).with_name("offload_peer.py")
MiB = 1 << 20
STARTUP_S = 60.0
REQUEST_BOUND_S = 8.0  # one store + lookup + load with a dead master: the 1 s call bound, a few times over


def tier(address: str, **settings: object) -> StoreTier:
    base: dict[str, object] = {"segment_bytes": 32 * MiB, "local_buffer_bytes": 16 * MiB, "timeout_s": 1.0}
    return StoreTier(StoreConfig(address, **{**base, **settings}))  # type: ignore[arg-type]


def device_digest(h: Harness, ids: list[int]) -> str:
    d = hashlib.sha256()
    for i in range(len(h.slots)):
        d.update(h.slot_bytes(i)[ids].contiguous().numpy().tobytes())
    return d.hexdigest()


@pytest.mark.parametrize("write_through", [False, True], ids=["write-back-on-eviction", "write-through"])
def test_a_prefix_the_host_tier_dropped_is_loaded_back_from_the_store(
    master: MooncakeMaster, write_through: bool
) -> None:
    h = Harness(small_spec(), host_blocks=2, store_tier=tier(master.address, write_through=write_through,
                                                              namespace=f"evict-{write_through}"))
    try:
        a, b = block_hashes(range(100, 104), 2), block_hashes(range(200, 204), 2)
        assert h.store("a", a, [1, 2]) == 2
        h.engine.wait_idle()
        assert h.store("b", b, [3, 4]) == 2  # the pool holds 2 blocks: a is evicted (written back first)
        h.engine.wait_idle()
        assert h.engine.index.cached_prefix(0, a) == 0
        assert h.engine.lookup(a) == 4  # found in the store
        assert h.engine.lookup(a, h.engine.store_presence(a)) == 4  # the store asked first, outside any lock
        stored = device_digest(h, [1, 2])
        h.zero([1, 2, 5, 6])
        assert h.load("la", a, [5, 6]) == 4
        assert device_digest(h, [5, 6]) == stored
        assert h.holds(5, a[0]) and h.holds(6, a[1])
        assert h.engine.get_block_ids_with_load_errors() == set()
        assert h.engine.host_blocks_in_use() == 0
        assert h.engine.store is not None and h.engine.store.tier.degradations == 0
    finally:
        h.engine.close()


def test_two_processes_share_a_prefix_through_one_store(master: MooncakeMaster, tmp_path: Path) -> None:
    writer = FramedProcess([str(PEER_SCRIPT), master.address], tmp_path / "writer.log")
    h = Harness(small_spec(), host_blocks=8, store_tier=tier(master.address, write_through=True))
    try:
        hello = writer.read(STARTUP_S)
        assert hello["fingerprint"] == h.engine.fingerprint  # same model, same layout: same keys
        prefix = block_hashes(range(300, 308), 2)
        reply = writer.ask(timeout=STARTUP_S, cmd="store", rid="w", hashes=prefix, ids=[10, 11, 12, 13])
        assert reply["stored"] == 4
        assert h.engine.index.cached_prefix(0, prefix) == 0  # nothing in this process's host tier
        assert h.engine.lookup(prefix) == 8
        assert h.load("r", prefix, [20, 21, 22, 23]) == 8
        assert device_digest(h, [20, 21, 22, 23]) == reply["sha256"]
        assert h.engine.host_blocks_in_use() == 0
    finally:
        h.engine.close()
        writer.close()


def test_a_master_killed_mid_run_degrades_to_the_host_tier_without_failing_or_leaking(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = start_master()  # this test kills it
    h = Harness(small_spec(), host_blocks=6, store_tier=tier(own.address, retry_after_s=3600.0))
    try:
        prefixes = [block_hashes(range(1000 * i, 1000 * i + 4), 2) for i in range(8)]
        with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
            for i, prefix in enumerate(prefixes):
                if i == 4:
                    own.kill()
                start = time.monotonic()
                ids = [2 * i % 40, 2 * i % 40 + 1]
                assert h.store(f"s{i}", prefix, ids) == 2
                h.engine.wait_idle(timeout_s=REQUEST_BOUND_S)
                h.zero(ids)
                assert h.engine.lookup(prefix) == 4  # just stored: the host tier holds it
                assert h.load(f"l{i}", prefix, [50, 51]) == 4
                assert h.holds(50, prefix[0]) and h.holds(51, prefix[1])
                assert time.monotonic() - start < REQUEST_BOUND_S
            # the first prefixes were evicted to the store, which is gone: a miss, bounded, never an error
            start = time.monotonic()
            tokens = h.load("gone", prefixes[0], [52, 53])
            assert time.monotonic() - start < REQUEST_BOUND_S
            assert tokens == 0 and h.engine.get_block_ids_with_load_errors() >= {52, 53}
        assert "unavailable" in caplog.text and "continuing with the host tier only" in caplog.text
        assert h.engine.store is not None and h.engine.store.tier.degradations == 1
        h.engine.wait_idle(timeout_s=REQUEST_BOUND_S)
        assert h.engine.host_blocks_in_use() == 0
        stored, loaded = h.engine.get_finished()
        assert stored == {f"s{i}" for i in range(8)}
        assert loaded == {f"l{i}" for i in range(8)} | {"gone"}
    finally:
        start = time.monotonic()
        h.engine.close()
        assert time.monotonic() - start < REQUEST_BOUND_S  # an unreachable client is abandoned, not waited on
        own.stop()


def test_start_master_names_a_missing_binary_and_a_port_in_use() -> None:
    with pytest.raises(MasterError, match="running /nonexistent/mooncake_master failed"):
        start_master(binary="/nonexistent/mooncake_master")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(MasterError, match=f"cannot listen on 127.0.0.1:{port}: the port is already in use"):
            start_master(port=port)


def test_the_installed_client_has_the_call_signatures_the_store_tier_uses() -> None:
    # StoreTier passes setup's arguments by position and reads these return conventions; a wheel that
    # reorders them must fail here, not misconfigure a store at run time
    from mooncake.store import MooncakeDistributedStore

    def params(method: str) -> list[str]:
        doc = getattr(MooncakeDistributedStore, method).__doc__ or ""
        sig = next(line for line in doc.splitlines() if f"{method}(self" in line)
        inner = sig[sig.index("(") + 1 : sig.rindex(")")]
        return [p.split(":")[0].strip() for p in inner.split(", ")[1:]]

    assert params("setup")[:7] == [
        "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
        "rdma_devices", "master_server_addr",
    ]
    assert params("batch_put_from")[:3] == ["keys", "buffer_ptrs", "sizes"]
    assert params("batch_get_into") == ["keys", "buffer_ptrs", "sizes"]
    assert params("batch_is_exist") == ["keys"]
    assert params("register_buffer") == ["buffer_ptr", "size"]
    assert "Returns 0 if healthy" in (MooncakeDistributedStore.health_check.__doc__ or "")


def test_the_real_client_answers_with_the_codes_the_store_tier_reads(master: MooncakeMaster) -> None:
    from mooncake.store import MooncakeDistributedStore

    from kvplane.backend import get_backend
    from kvplane.flows.offload.store import INVALID_PARAMS, OBJECT_NOT_FOUND

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    buf = get_backend("cpu").alloc_host(1 * MiB)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).to(torch.uint8))
    base = int(buf.data_ptr())
    assert client.register_buffer(base, buf.numel()) == 0
    keys = ["codes/a", "codes/b"]
    assert list(client.batch_put_from(keys, [base, base + 4096], [4096, 4096])) == [0, 0]
    assert list(client.batch_is_exist([*keys, "codes/missing"])) == [1, 1, 0]
    got = client.batch_get_into([*keys, "codes/missing"], [base + 65536, base + 69632, base + 73728], [4096] * 3)
    assert list(got) == [4096, 4096, OBJECT_NOT_FOUND]  # bytes read per key; a miss is -704
    assert bytes(buf[65536:73728].numpy()) == bytes(buf[0:8192].numpy())
    assert list(client.batch_get_into(["codes/a"], [base], [1024])) == [INVALID_PARAMS]  # too small a buffer
    assert client.health_check() == 0
    client.close()
