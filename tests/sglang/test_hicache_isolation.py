"""Two deployments sharing one Mooncake master never read each other's pages: a page is found only by a reader of
the same namespace, model, TP shard, host layout and dtype; for MLA, whose pages every TP rank holds alike, by
any TP size."""

from __future__ import annotations

import pytest
import torch
from hicache_pools import extra_config, fill, host, page_bytes, page_hashes, slots, storage_config

from kvplane.flows.offload import MooncakeMaster

pytestmark = pytest.mark.integration


def write_pages(backends, master: MooncakeMaster, namespace: str, keys: list[str]):
    pool = host("mha", "page_first")
    fill(pool, seed=31)
    writer = backends(storage_config(extra_config(master.address, namespace=namespace), tp_size=2, tp_rank=0), pool)
    assert writer.batch_set_v1(keys, slots(pool, [1, 2, 3])) == [True] * 3
    return pool


@pytest.mark.parametrize("other", [
    {"model": "org/model-b"},
    {"tp_size": 4, "tp_rank": 0},
    {"tp_size": 2, "tp_rank": 1},
    {"namespace": "another-deployment"},
], ids=["other-model", "other-tp-size", "other-rank", "other-namespace"])
def test_a_reader_of_another_model_tp_shard_or_namespace_misses(
    master: MooncakeMaster, backends, other: dict[str, object]
) -> None:
    keys = page_hashes(3, seed=30)
    write_pages(backends, master, "isolation", keys)
    namespace = str(other.pop("namespace", "isolation"))
    shard = {"tp_size": 2, "tp_rank": 0, **other}
    pool = host("mha", "page_first")
    fill(pool, seed=32)
    before = [page_bytes(pool, p * pool.page_size) for p in (5, 6, 7)]
    reader = backends(storage_config(extra_config(master.address, namespace=namespace), **shard), pool)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, slots(pool, [5, 6, 7])) == [False] * 3
    assert [page_bytes(pool, p * pool.page_size) for p in (5, 6, 7)] == before


@pytest.mark.parametrize("layout, dtype", [("page_first_direct", torch.bfloat16), ("page_first", torch.float16)],
                         ids=["same-sizes-other-byte-order", "same-sizes-other-dtype"])
def test_a_reader_of_another_layout_or_dtype_misses_even_when_the_sizes_match(
    master: MooncakeMaster, backends, layout: str, dtype: torch.dtype
) -> None:
    keys = page_hashes(3, seed=33)
    write_pages(backends, master, "formats", keys)
    pool = host("mha", layout, dtype=dtype)
    reader = backends(storage_config(extra_config(master.address, namespace="formats"), tp_size=2, tp_rank=0,
                                     layout=layout), pool)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, slots(pool, [5, 6, 7])) == [False] * 3


def test_mla_pages_are_shared_across_tp_sizes_with_the_same_bytes(master: MooncakeMaster, backends) -> None:
    extra = extra_config(master.address, namespace="mla-tp")
    written, read = host("mla", "page_first"), host("mla", "page_first")
    fill(written, seed=34)
    fill(read, seed=35)
    keys = page_hashes(3, seed=34)
    writer = backends(storage_config(extra, mla=True, tp_size=2, tp_rank=0), written)
    reader = backends(storage_config(extra, mla=True, tp_size=8, tp_rank=5), read)
    assert writer.batch_set_v1(keys, slots(written, [1, 2, 3])) == [True] * 3
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, slots(read, [4, 5, 6])) == [True] * 3
    size = written.page_size
    assert [page_bytes(read, p * size) for p in (4, 5, 6)] == [page_bytes(written, p * size) for p in (1, 2, 3)]
