"""End to end: a tiny model's prefill runs in one instance, decode in another, KV moved by kvplane.

Every case compares the decode instance's generated tokens and logits, bit for bit, with one process running
prefill and decode itself. Instances are separate processes (TP ranks too); the KV goes through Mooncake TE or
NIXL on 127.0.0.1, pulled, pushed or pushed layer by layer, across heterogeneous deployments: TP 1->2 and
2->1, MLA's replicated cache, block sizes 16<->32, two KV-cache groups, fused against split MLA.
"""

from __future__ import annotations

import itertools

import pytest
from e2e_run import Side, check
from rank_pool import Pool

pytestmark = pytest.mark.integration


GQA, MLA = Side("gqa", "packed_kv"), Side("mla", "mla_fused")
MODES = ("pull", "push", "layerwise")
ENGINES = ("mooncake", "nixl")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", [GQA, MLA], ids=["gqa", "mla"])
def test_decode_output_equals_a_single_process_run(pool: Pool, side: Side, mode: str, engine: str) -> None:
    check(pool, side, side, engine, mode)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_push_registered_after_the_prefill_finished_still_lands(pool: Pool, engine: str) -> None:
    check(pool, GQA, GQA, engine, "push", push_first=False)


HETERO = {
    "tp1-to-tp2-split_kv": (Side("gqa", "split_kv"), Side("gqa", "split_kv", tp=2)),
    "tp2-to-tp1-hnd": (Side("gqa", "packed_kv@HND", tp=2), Side("gqa", "packed_kv@HND")),
    "tp2-to-tp1-split_kv": (Side("gqa", "split_kv", tp=2), Side("gqa", "split_kv")),
    "mla-replicated-tp2-to-tp2": (Side("mla", "mla_fused", tp=2), Side("mla", "mla_fused", tp=2)),
    "bs16-to-bs32": (Side("gqa", "split_kv", 16), Side("gqa", "split_kv", 32)),
    "bs32-to-bs16": (Side("gqa", "split_kv", 32), Side("gqa", "split_kv", 16)),
    "two-groups": (Side("gqa", "packed_kv", 16, block_1=32), Side("gqa", "split_kv", 16, block_1=32)),
    "mla-fused-to-split": (Side("mla", "mla_fused"), Side("mla", "mla_split")),
    "mla-split-to-fused": (Side("mla", "mla_split", 32), Side("mla", "mla_fused", 16)),
}
CASES = [(name, mode, ENGINES[i % 2]) for i, (name, mode) in enumerate(itertools.product(HETERO, MODES))]


@pytest.mark.parametrize("name,mode,engine", CASES, ids=[f"{n}-{m}-{e}" for n, m, e in CASES])
def test_heterogeneous_deployments_decode_exactly_as_one_process(pool: Pool, name: str, mode: str, engine: str
                                                                 ) -> None:
    prefill, decode = HETERO[name]
    check(pool, prefill, decode, engine, mode)


STAGED = ("tp2-to-tp1-split_kv", "tp1-to-tp2-split_kv", "mla-fused-to-split")
SMALL_STAGING = 2560  # two source blocks of one MLA layer; each of these pulls stages 3-5x that per decode rank


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", STAGED)
def test_staged_pulls_larger_than_staging_bytes_decode_exactly_as_one_process(pool: Pool, name: str, engine: str
                                                                               ) -> None:
    prefill, decode = HETERO[name]
    check(pool, prefill, decode, engine, "pull", staging_bytes=SMALL_STAGING)
