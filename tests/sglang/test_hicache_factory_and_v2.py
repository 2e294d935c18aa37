"""SGLang loads the backend through its own factory from the documented extra config, a bad extra config is an
error naming the key, and the v2 per-pool calls answer under the hit policy SGLang names for each side pool."""

from __future__ import annotations

import json

import pytest
from hicache_pools import MiB, extra_config, fill, host, page_bytes, page_hashes, slots, storage_config
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvplane.flows.offload import MooncakeMaster, OffloadConfigError
from kvplane.integrations.sglang import CLASS_NAME, MODULE_PATH
from kvplane.integrations.sglang.backend import KvplaneHiCacheStorage
from kvplane.integrations.sglang.settings import HiCacheConfigError, example

pytestmark = pytest.mark.integration


def test_sglang_s_factory_loads_the_backend_from_the_documented_extra_config(master: MooncakeMaster) -> None:
    extra = json.loads(example(master.address))  # what docs/engines-sglang.md tells users to pass
    assert extra["module_path"] == MODULE_PATH and extra["class_name"] == CLASS_NAME
    pool = host("mha", "page_first")
    fill(pool, seed=50)
    # as HiCacheController.attach_storage_backend does (managers/cache_controller.py)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config({**extra, "namespace": "factory"}),
                                                   pool)
    try:
        assert isinstance(backend, KvplaneHiCacheStorage)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        keys = page_hashes(2, seed=50)
        assert backend.batch_set_v1(keys, slots(pool, [1, 2])) == [True, True]
        assert backend.batch_exists(keys) == 2
        assert backend.batch_get_v1(keys, slots(pool, [3, 4])) == [True, True]
        assert page_bytes(pool, 3 * pool.page_size) == page_bytes(pool, 1 * pool.page_size)
    finally:
        backend.close()


@pytest.mark.parametrize("change, named", [
    ({"interface_v1": 0}, "interface_v1=0"),
    ({"master_adress": "127.0.0.1:1"}, "unknown key(s) ['master_adress']"),
    ({"protocol": "udp"}, "$.protocol='udp'"),
    ({"timeout_s": -1}, "$.timeout_s=-1.0 must be > 0"),
    ({"late_wait_s": "soon"}, "late_wait_s='soon'"),
    ({"master_address": None}, "master_address is required"),
    ({"segment_bytes": MiB}, "StoreConfig.segment_bytes=1048576"),
])
def test_a_bad_extra_config_is_an_error_naming_the_key_and_value(
    master: MooncakeMaster, change: dict[str, object], named: str
) -> None:
    extra = {k: v for k, v in {**extra_config(master.address), **change}.items() if v is not None}
    with pytest.raises(OffloadConfigError) as raised:
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    assert named in str(raised.value)
    assert isinstance(raised.value, HiCacheConfigError) or "segment_bytes" in named


def hybrid(master: MooncakeMaster, backends, namespace: str):
    kv, swa = host("mha", "page_first"), host("mha", "page_first", layers=2)
    fill(kv, seed=51)
    fill(swa, seed=52)
    backend = backends(storage_config(extra_config(master.address, namespace=namespace)), kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    backend.on_host_pools_registered()
    keys = page_hashes(6, seed=51)
    assert backend.batch_set_v1(keys, slots(kv, list(range(1, 7)))) == [True] * 6
    # SWA state only at the ends of two spans: after page 3 and after page 6 (one trailing page each)
    written = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots(swa, [8, 9]),
                                                 keys=[keys[2], keys[5]])])
    assert written == {PoolName.SWA: [True, True]}
    return backend, keys, swa


def test_trailing_pages_restore_only_the_prefixes_whose_window_is_stored(master: MooncakeMaster, backends) -> None:
    backend, keys, swa = hybrid(master, backends, "v2-trailing")
    ask = PoolTransfer(name=PoolName.SWA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = backend.batch_exists_v2(keys, [ask])
    assert result.restorable_prefix_pages == [3, 6]  # a hole at 4 and 5: no SWA state ends there
    assert result.kv_hit_pages == 6 and result.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 6}
    wide = PoolTransfer(name=PoolName.SWA, keys=keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert backend.batch_exists_v2(keys, [wide]).kv_hit_pages == 0  # no two consecutive pages of state
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots(swa, [20]), keys=[keys[5]])])
    assert got == {PoolName.SWA: [True]}
    assert page_bytes(swa, 20 * swa.page_size) == page_bytes(swa, 9 * swa.page_size)


def test_all_pages_needs_every_page_and_an_unserved_policy_or_pool_is_a_miss(
    master: MooncakeMaster, backends
) -> None:
    backend, keys, _ = hybrid(master, backends, "v2-all")
    every = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert backend.batch_exists_v2(keys, [every]).restorable_prefix_pages == []  # page 1 has no SWA object
    assert backend.batch_exists_v2(keys).kv_hit_pages == 6
    groups = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert backend.batch_exists_v2(keys, [groups]).kv_hit_pages == 0
    unknown = PoolTransfer(name=PoolName.MAMBA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert backend.batch_exists_v2(keys, [unknown]).kv_hit_pages == 0
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(host("mha", "page_first"), [1]),
                                              keys=keys[:1])]) == {PoolName.MAMBA: [False]}
