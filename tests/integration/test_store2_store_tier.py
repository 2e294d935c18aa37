"""The store tier against a real ``mooncake_master`` on loopback: a full segment's refusals are counted and
logged once per stretch, a segment Mooncake would refuse is an error at setup, and a master that takes the
connection and never answers costs the bounded probe, not a frozen process.

Each test here failed on main before its fix.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from kvplane.backend import get_backend
from kvplane.flows.offload import MooncakeMaster, OffloadConfigError, StoreConfig
from kvplane.flows.offload.store import NO_AVAILABLE_HANDLE, StoreTier, StoreWrite

pytestmark = pytest.mark.integration
MiB = 1 << 20
STORE_LOG = "kvplane.offload.store"


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STORE_LOG and "refused" in r.getMessage()]


def put_and_check(tier: StoreTier, key: str, addr: int, size: int) -> list[int]:
    future = tier.put([key], [addr], [size])
    assert future is not None, "the store tier is down"
    future.result(30.0)
    assert tier.check_put(StoreWrite(future, float("inf"), 0, None, size))
    return future.result()


def fill(tier: StoreTier, name: str, addr: int, puts: int) -> list[int]:
    """``puts`` objects of 1 MiB in one batched put; their return codes. The only segment in this master's
    cluster is 16 MiB, so once 16 are in, the rest are refused (-200). One batch, because the master's eviction
    makes room between separate puts: on a loaded machine 40 puts one by one were all taken (a busy `make test`;
    reproduced by sleeping 0.4 s between them), while one batch is allocated in one master call."""
    future = tier.put([f"store2/{name}/{i}" for i in range(puts)], [addr] * puts, [MiB] * puts)
    assert future is not None, "the store tier is down"
    future.result(60.0)
    assert tier.check_put(StoreWrite(future, float("inf"), 0, None, puts * MiB))
    return future.result()


def test_a_full_segment_logs_its_refusals_once_per_stretch_and_counts_them(
    master: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    # a full segment under write-through refused every put, and every refusal logged its own warning
    tier = StoreTier(StoreConfig(master.address, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB, timeout_s=10.0,
                                 namespace="store2-full", retry_after_s=3600.0))
    other = None
    buf = get_backend("cpu").alloc_host(MiB)
    base = int(buf.data_ptr())
    try:
        tier.register(base, buf.numel())
        tier.refusal_log_every_s = 3600.0  # one stretch: no periodic line inside this test
        with caplog.at_level(logging.WARNING, logger=STORE_LOG):
            codes = fill(tier, "full", base, 40)
        refused = codes.count(NO_AVAILABLE_HANDLE)
        assert refused >= 10 and set(codes) <= {0, NO_AVAILABLE_HANDLE}, codes
        lines = refusal_lines(caplog)
        assert len(lines) == 1, lines
        assert "StoreConfig.segment_bytes=16777216" in lines[0] and "-200" in lines[0]
        assert tier.refused[NO_AVAILABLE_HANDLE] == refused
        assert tier.degradations == 0, "a refusal for room is not a store that went away"
        # another client lends a segment: puts are taken again, and the stretch's end is logged once, with its count
        from mooncake.store import MooncakeDistributedStore

        other = MooncakeDistributedStore()
        assert other.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
        caplog.clear()
        tier.refusal_log_every_s = 0.0  # "none refused for that long" holds at the next taken put
        with caplog.at_level(logging.WARNING, logger=STORE_LOG):
            assert put_and_check(tier, "store2/after/0", base, MiB) == [0]
            assert put_and_check(tier, "store2/after/1", base, MiB) == [0]
        again = [r.getMessage() for r in caplog.records if "takes puts again" in r.getMessage()]
        assert len(again) == 1 and f"after refusing {refused} " in again[0], again
        assert tier.refused[NO_AVAILABLE_HANDLE] == refused
    finally:
        tier.close()
        if other is not None:
            other.close()


def put_until_refused(tier: StoreTier, name: str, addr: int, first: int) -> list[int]:
    """1 MiB puts from key number ``first`` on, up to and including the first one refused; their return codes."""
    codes: list[int] = []
    while not codes or codes[-1] >= 0:
        assert len(codes) < 200, "the full segment never refused a put"
        codes += put_and_check(tier, f"store2/{name}/{first + len(codes)}", addr, MiB)
    return codes


def test_the_periodic_line_of_a_long_stretch_counts_what_it_did_not_log(
    master: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    """A stretch of refusals logs its first line, then one per interval counting the refusals it did not log.
    The master's eviction makes room for a put now and then, and a put taken once the interval has passed ends
    the stretch (as it should): then the test waits for the next stretch and tries again."""
    tier = StoreTier(StoreConfig(master.address, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB, timeout_s=10.0,
                                 namespace="store2-period", retry_after_s=3600.0))
    buf = get_backend("cpu").alloc_host(MiB)
    base = int(buf.data_ptr())
    every: list[int] = []  # every put's code, over all tries
    try:
        tier.register(base, buf.numel())
        with caplog.at_level(logging.WARNING, logger=STORE_LOG):
            for _ in range(50):
                tier.refusal_log_every_s = 3600.0  # inside the stretch: counted, not logged
                caplog.clear()
                stretch = put_until_refused(tier, "period", base, len(every))  # its first refusal writes a line
                stretch += put_and_check(tier, f"store2/period/{len(every) + len(stretch)}", base, MiB)
                tier.refusal_log_every_s = 0.0  # the interval has passed: a refusal now writes the summary
                stretch += put_and_check(tier, f"store2/period/{len(every) + len(stretch)}", base, MiB)
                every += stretch
                if stretch[-1] < 0:
                    break  # otherwise the master made room once more and the stretch ended: try the next one
        lines = refusal_lines(caplog)
        assert len(lines) == 2 and "more put(s)" in lines[1], (lines, stretch)
        first = next(i for i, rc in enumerate(stretch) if rc < 0)  # the refusal that started the stretch
        assert f"refused {sum(rc < 0 for rc in stretch[first + 1:])} more put(s)" in lines[1], (lines, stretch)
        assert tier.refused[NO_AVAILABLE_HANDLE] == every.count(NO_AVAILABLE_HANDLE)
    finally:
        tier.close()


@pytest.mark.parametrize("segment_bytes", [1 * MiB, 16 * MiB - 1])
def test_a_segment_mooncake_would_refuse_is_an_error_at_setup_naming_the_field(
    master: MooncakeMaster, segment_bytes: int
) -> None:
    # Mooncake refuses a segment under 16 MiB (setup -600, said only in its own log): the tier turned itself off
    # for good with "setup returned -600", naming no field
    with pytest.raises(OffloadConfigError) as raised:
        StoreTier(StoreConfig(master.address, segment_bytes=segment_bytes, local_buffer_bytes=16 * MiB))
    text = str(raised.value)
    assert f"StoreConfig.segment_bytes={segment_bytes}" in text and "at least 16 MiB" in text and "or 0" in text


@pytest.fixture
def silent_master() -> Iterator[str]:
    """A socket that accepts every connection and never answers (a wedged or stopped master)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    taken: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                taken.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, name="store2-silent-master", daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2.0)
    for conn in taken:
        conn.close()
    listener.close()


def test_a_master_that_accepts_and_never_answers_does_not_freeze_the_process(
    silent_master: str, caplog: pytest.LogCaptureFixture
) -> None:
    # the binding's setup holds the GIL until it gives up (about 90 s): the TCP check let it through, and the
    # whole process stood still; now a probe client in a child process meets the silence, bounded
    ticks: list[int] = []
    stop = threading.Event()

    def tick() -> None:  # runs only while this process is not frozen
        while not stop.wait(0.05):
            ticks.append(1)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    with caplog.at_level(logging.WARNING, logger=STORE_LOG):
        tier = StoreTier(StoreConfig(silent_master, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB,
                                     setup_timeout_s=2.0, retry_after_s=3600.0))
    try:
        assert not tier.up and tier.degradations == 1
        assert "accepts connections but a client's setup got no answer" in caplog.text
        assert f"StoreConfig.master_address={silent_master!r}" in caplog.text
        assert ticks, "no other thread ran while the tier set up: the process was frozen"
    finally:
        stop.set()
        tier.close()


def test_a_process_that_cannot_start_the_probe_sets_up_unprobed_with_a_warning(
    master: MooncakeMaster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvplane.flows.offload.store as store

    monkeypatch.setattr(store.sys, "executable", "/nonexistent/python")
    monkeypatch.setattr(store, "_answered", {})  # probed by no earlier test of this module
    with caplog.at_level(logging.WARNING, logger=STORE_LOG):
        tier = StoreTier(StoreConfig(master.address, segment_bytes=16 * MiB, local_buffer_bytes=16 * MiB,
                                     namespace="store2-unprobed"))
    try:
        assert tier.degradations == 0 and tier.up
        assert "cannot start the probe" in caplog.text and "/nonexistent/python" in caplog.text
    finally:
        tier.close()
