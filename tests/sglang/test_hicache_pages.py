"""Pages of SGLang's own host pools through the kvplane backend and a real ``mooncake_master``, byte for byte.

One backend (a rank of one instance) writes pages from its host pool with ``batch_set_v1``; another backend with
a host pool of its own (another instance, or another TP rank of an MLA model) finds them with ``batch_exists``
and reads them with ``batch_get_v1`` into other host slots. The bytes SGLang's ``get_data_page`` reads there are
the bytes written, in every host layout.
"""

from __future__ import annotations

import pytest
from hicache_pools import LAYOUTS, extra_config, fill, host, page_bytes, page_hashes, slots, storage_config

from kvplane.flows.offload import MooncakeMaster

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_written_by_one_instance_are_read_byte_for_byte_by_another(
    master: MooncakeMaster, backends, kind: str, layout: str
) -> None:
    extra = extra_config(master.address, namespace=f"pages-{kind}-{layout}")
    writer_pool, reader_pool = host(kind, layout), host(kind, layout)
    fill(writer_pool, seed=1)
    fill(reader_pool, seed=2)
    writer = backends(storage_config(extra, mla=kind == "mla", layout=layout), writer_pool)
    reader = backends(storage_config(extra, mla=kind == "mla", layout=layout), reader_pool)
    keys = page_hashes(6, seed=11)
    src, dst = [1, 2, 3, 7, 8, 9], [20, 5, 30, 11, 4, 12]

    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, slots(writer_pool, src)) == [True] * 6
    assert reader.batch_exists(keys) == 6
    assert reader.batch_get_v1(keys, slots(reader_pool, dst)) == [True] * 6

    size = writer_pool.page_size
    for s, d in zip(src, dst):
        assert page_bytes(reader_pool, d * size) == page_bytes(writer_pool, s * size)
    assert page_bytes(reader_pool, 6 * size) != page_bytes(writer_pool, 6 * size)  # untouched slots stay apart


def test_batch_exists_counts_the_leading_pages_only(master: MooncakeMaster, backends) -> None:
    pool = host("mha", "page_first")
    fill(pool, seed=3)
    backend = backends(storage_config(extra_config(master.address, namespace="leading")), pool)
    keys = page_hashes(5, seed=12)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], slots(pool, [1, 2, 4])) == [True] * 3
    assert backend.batch_exists(keys) == 2  # page 2 is missing: page 3 does not count
    assert backend.batch_exists(keys[3:4]) == 1
    assert backend.exists(keys[3]) and not backend.exists(keys[2])


def test_a_page_already_stored_is_not_put_again_and_still_answers_true(master: MooncakeMaster, backends) -> None:
    pool = host("mha", "page_first")
    fill(pool, seed=4)
    backend = backends(storage_config(extra_config(master.address, namespace="again")), pool)
    keys = page_hashes(3, seed=13)
    assert backend.batch_set_v1(keys[:2], slots(pool, [1, 2])) == [True, True]
    first = page_bytes(pool, 1 * pool.page_size)
    fill(pool, seed=5)  # the host slots change; the stored page must not
    assert backend.batch_set_v1(keys, slots(pool, [1, 2, 3])) == [True] * 3
    assert backend.batch_get_v1(keys[:1], slots(pool, [9])) == [True]
    assert page_bytes(pool, 9 * pool.page_size) == first


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_pages_are_written_by_the_writer_rank_and_read_by_every_rank(
    master: MooncakeMaster, backends, layout: str
) -> None:
    extra = extra_config(master.address, namespace=f"mla-ranks-{layout}")
    pools = [host("mla", layout) for _ in range(2)]
    for seed, pool in enumerate(pools):
        fill(pool, seed=20 + seed)
    rank0, rank1 = (backends(storage_config(extra, mla=True, tp_size=2, tp_rank=r, layout=layout), pools[r])
                    for r in range(2))
    keys = page_hashes(4, seed=14)

    # rank 1 is not SGLang's storage writer for MLA: it answers True and stores nothing
    assert rank1.batch_set_v1(keys, slots(pools[1], [1, 2, 3, 4])) == [True] * 4
    assert rank0.batch_exists(keys) == 0 and rank1.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, slots(pools[0], [5, 6, 7, 8])) == [True] * 4
    assert rank1.batch_exists(keys) == 4
    assert rank1.batch_get_v1(keys, slots(pools[1], [10, 11, 12, 13])) == [True] * 4
    size = pools[0].page_size
    for s, d in zip([5, 6, 7, 8], [10, 11, 12, 13]):
        assert page_bytes(pools[1], d * size) == page_bytes(pools[0], s * size)
