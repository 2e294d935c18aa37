"""SGLang HiCache: kvplane's Mooncake Store tier as a ``HiCacheStorage`` backend that SGLang loads by name.

SGLang loads it with no change of its own (``--hicache-storage-backend dynamic``; see
``docs/engines-sglang.md``). Only ``backend.py`` imports SGLang, and nothing imports ``backend.py`` but SGLang's
``StorageBackendFactory``: ``import kvplane`` and this package work where SGLang is absent. The other modules
are SGLang-free: ``settings.py`` reads the extra config, ``keys.py`` names the objects, ``pages.py`` turns a host
pool's page addresses into arrays, ``page_store.py`` moves pages through ``StoreTier`` and ``hits.py`` applies
the per-pool hit policies of the v2 calls.
"""

MODULE_PATH = "kvplane.integrations.sglang.backend"
CLASS_NAME = "KvplaneHiCacheStorage"

__all__ = ["CLASS_NAME", "MODULE_PATH"]
