"""P/D across two hosts: a prefill in one network namespace and a decode in another, over a veth pair, with
both transports, pull and push, and the faults a network makes. Bytes are compared with the prefill's.

Link down mid-transfer and back up is ``test_link_down.py``. Delay needs ``netem``, which this kernel lacks
(the test says so when it skips); elsewhere it runs with 5 ms each way.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from netpair import Pair
from nslink import Link

from kvplane.kv.spec import KVSpec

pytestmark = pytest.mark.integration
SPEC = KVSpec.gqa(8, 8, 128, tokens_per_block=16)  # 32 KiB a token
TOKENS, BLOCKS = 512, 80  # 16 MiB a request
MODES = ["pull", "push"]
ENGINES = ["mooncake", "nixl"]
SETTINGS = {"transfer_timeout_s": 30.0, "push_timeout_s": 40.0}


def one_request(pair: Pair, request_id: str) -> None:
    src, dst = list(range(1, 33)), list(range(40, 72))
    pair.start(request_id, src, dst, TOKENS)
    done = pair.wait(request_id, 60)
    assert done["state"] == "done", done
    assert pair.same_bytes(src, dst, TOKENS)
    assert pair.wait(request_id, 30, role="prefill")["state"] == "done"
    assert pair.status()["pending"] == 0 and pair.status("prefill")["held"] == 0


def _fault(link: Link, fault: str) -> str:
    """Apply ``fault`` to the link; the reason it cannot be applied here, or ""."""
    if fault == "1% loss":
        link.loss(0.01)
        return ""
    why = link.netem("delay", "5ms")
    return f"{why} (this kernel has no netem; NFQUEUE delay in userspace is too slow to carry a transfer)" if why \
        else ""


@pytest.mark.parametrize("fault", ["1% loss", "5 ms delay each way"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine", ENGINES)
def test_pd_across_namespaces_completes_under_a_fault_bytes_equal(
    link: Link, tmp_path: Path, engine: str, mode: str, fault: str
) -> None:
    why = _fault(link, fault)
    if why:
        pytest.skip(f"no {fault} fault here: {why}")
    pair = Pair(link, tmp_path, engine, mode, SPEC, BLOCKS, **SETTINGS)
    try:
        one_request(pair, "lossy" if fault == "1% loss" else "delayed")
    finally:
        pair.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_advertising_an_address_the_prefill_cannot_reach_fails_naming_it(
    link: Link, tmp_path: Path, engine: str, mode: str
) -> None:
    """The decode's transport names an address on a device of its own that the prefill has no route to: the
    request fails (never hangs), and the reason names that address."""
    addr, dev = link.unreachable_address()
    env = {"UCX_NET_DEVICES": dev} if engine == "nixl" else {}  # NIXL's metadata carries the device's address
    pair = Pair(link, tmp_path, engine, mode, SPEC, BLOCKS, decode_env=env, decode_host=addr,
                transfer_timeout_s=5.0, push_timeout_s=8.0, handshake_timeout_s=5.0)
    try:
        start = time.monotonic()
        src, dst = list(range(1, 33)), list(range(40, 72))
        pair.start("lost", src, dst, TOKENS)
        done = pair.wait("lost", 60)
        assert done["state"] in ("failed", "timed_out"), done
        assert addr in done["reason"], done["reason"]
        print(f"{engine} {mode}: failed in {time.monotonic() - start:.1f} s: {done['reason']}")
        assert pair.status()["pending"] == 0
    finally:
        pair.close()
