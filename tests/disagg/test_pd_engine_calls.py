"""The engine thread never waits on a side's I/O loop: ``get_finished`` with any timeout loses nothing, and
returns while a large transfer is still moving (NIXL copies synchronously inside ``transfer()`` with cma, which
used to hold the loop, and every engine call behind it, for the whole transfer)."""

from __future__ import annotations

import time

import pytest
import torch
from pair import make, small_spec

from kvplane.kv.spec import KVSpec

pytestmark = pytest.mark.integration
BIG = KVSpec.gqa(8, 8, 128, tokens_per_block=16)  # 32 KiB a token
BIG_TOKENS, BIG_BLOCKS = 16_384, 1100  # 512 MiB


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_timed_out_get_finished_loses_no_completion(engine: str) -> None:
    spec = small_spec()
    prefill, decode = make("prefill", spec, seed=3, engine=engine), make("decode", spec, engine=engine)
    try:
        names = [f"r{i}" for i in range(8)]
        for name in names:
            params = prefill.side.request_finished(name, prefill.allocate(40), 40)
            decode.side.start_pull(name, params, decode.allocate(40))
        seen: list[str] = []
        end = time.monotonic() + 30
        while len(seen) < len(names) and time.monotonic() < end:
            try:
                seen += [c.request_id for c in decode.side.get_finished(timeout_s=1e-6)]
            except TimeoutError:  # what the old get_finished raised, losing the drained completions
                pass
        assert sorted(seen) == names  # each exactly once
        for name in names:
            decode.side.start_pull(name + "-again", prefill.side.request_finished(name + "-again",
                                   prefill.allocate(40), 40), decode.allocate(40))
        assert all(decode.wait(n + "-again").state == "done" for n in names)
    finally:
        decode.close()
        prefill.close()


def test_get_finished_returns_while_a_large_nixl_read_is_still_moving() -> None:
    prefill = make("prefill", BIG, num_blocks=BIG_BLOCKS, seed=9, engine="nixl", transfer_timeout_s=60.0)
    decode = make("decode", BIG, num_blocks=BIG_BLOCKS, engine="nixl", transfer_timeout_s=60.0)
    try:
        src = prefill.allocate(BIG_TOKENS)
        dst = decode.allocate(BIG_TOKENS)
        params = prefill.side.request_finished("big", src, BIG_TOKENS)
        layer = BIG.layer_names[-1]
        last_src = prefill.cache[layer][src[-1]].clone()  # packed_kv: blocks are dim 0

        def last_block_landed() -> bool:
            return bool(torch.equal(decode.cache[layer][dst[-1]].contiguous().view(torch.int16),
                                    last_src.contiguous().view(torch.int16)))

        decode.side.start_pull("big", params, dst)
        end = time.monotonic() + 30
        while decode.side.transfers_in_flight() == 0:
            assert time.monotonic() < end, "the READ never started"
            time.sleep(0.0005)
        finished = decode.side.get_finished()
        assert finished == [] and not last_block_landed()  # it returned before the transfer's last bytes
        assert decode.wait("big", 60).state == "done" and last_block_landed()
    finally:
        decode.close()
        prefill.close()


def test_a_read_longer_than_the_lease_completes_because_heartbeats_keep_flowing() -> None:
    """The decode's heartbeats renew the prefill's lease while its transfer thread copies (they used to wait
    behind NIXL's synchronous copy on the decode's I/O loop, so a READ longer than the lease lost its blocks)."""
    tokens, blocks = 2 * BIG_TOKENS, 2 * BIG_BLOCKS + 2  # 1 GiB
    bounds = {"engine": "nixl", "transfer_timeout_s": 60.0, "lease_s": 0.6, "heartbeat_s": 0.1}
    prefill = make("prefill", BIG, num_blocks=blocks, seed=9, **bounds)  # type: ignore[arg-type]
    decode = make("decode", BIG, num_blocks=blocks, **bounds)  # type: ignore[arg-type]
    try:
        warm_src, warm_dst = prefill.allocate(16), decode.allocate(16)  # handshake first: the lease is for the READ
        decode.side.start_pull("warm", prefill.side.request_finished("warm", warm_src, 16), warm_dst)
        decode.wait("warm", 30)  # done, or failed when the handshake outlasted the short lease: connected either way
        prefill.wait("warm", 30)
        src, dst = prefill.allocate(tokens), decode.allocate(tokens)
        decode.side.start_pull("long", prefill.side.request_finished("long", src, tokens), dst)
        assert decode.wait("long", 60).state == "done"
        assert prefill.wait("long", 30).state == "done"  # not timed_out: the lease never lapsed
    finally:
        decode.close()
        prefill.close()
