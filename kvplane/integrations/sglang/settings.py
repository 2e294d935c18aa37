"""What the backend reads from SGLang's ``--hicache-storage-backend-extra-config``, checked once at start.

SGLang hands the backend the extra config's dict as ``HiCacheStorageConfig.extra_config``. It holds SGLang's
own keys (``backend_name``, ``module_path``, ``class_name``, which the factory reads; ``interface_v1``, which
picks the zero-copy page calls) beside the store's: every other key is a ``StoreConfig`` field
(``master_address``, ``protocol``, ``segment_bytes``, ...), built with ``kvplane.config.build`` so a misspelt
key, a wrong type or a value out of range is an error naming the key, the value and the fix. ``late_wait_s`` is
the backend's own (see ``HiCacheSettings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.config import build
from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError

WHAT = "--hicache-storage-backend-extra-config"
# keys SGLang itself reads from the same dict (storage/backend_factory.py, managers/cache_controller.py,
# pool_host/common.py get_allocator_type); tp_lcm_size is popped by SGLang before the backend sees it
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size"})
OWN_KEYS = frozenset({"late_wait_s"})


class HiCacheConfigError(OffloadConfigError):
    """The extra config SGLang passed cannot configure the kvplane HiCache backend."""


@dataclass(frozen=True)
class HiCacheSettings:
    """The store tier's settings and the backend's own.

    ``late_wait_s``: a get or put that runs past the store tier's bound is reported failed, but the Mooncake call
    may still be moving bytes into or out of SGLang's host pages. SGLang keeps those pages for the request until
    the call returns, so the call waits up to this many seconds more for the straggler before returning; past
    that it logs an error (the pages may then be written after SGLang reuses them).
    """

    store: StoreConfig
    late_wait_s: float = 30.0


def parse_settings(extra: Mapping[str, Any] | None) -> HiCacheSettings:
    """The settings in SGLang's extra config; ``HiCacheConfigError`` naming the key, the value and the fix."""
    if extra is None:
        raise HiCacheConfigError(f"{WHAT} is missing; pass at least {example()}")
    if not extra.get("interface_v1"):
        raise HiCacheConfigError(
            f"{WHAT}: interface_v1={extra.get('interface_v1')!r}: the kvplane backend moves pages zero-copy through "
            f"SGLang's v1 calls (batch_get_v1/batch_set_v1), which SGLang uses for a dynamic backend only with "
            f"\"interface_v1\": 1 (managers/cache_controller.py); add it"
        )
    late = extra.get("late_wait_s", HiCacheSettings.late_wait_s)
    if isinstance(late, bool) or not isinstance(late, (int, float)) or not late > 0:
        raise HiCacheConfigError(f"{WHAT}: late_wait_s={late!r} must be a number of seconds > 0")
    raw = {k: v for k, v in extra.items() if k not in SGLANG_KEYS | OWN_KEYS}
    if "master_address" not in raw:
        raise HiCacheConfigError(f"{WHAT}: master_address is required and missing; e.g. {example()}")
    store = build(StoreConfig, raw, what=WHAT, error=HiCacheConfigError)
    return HiCacheSettings(store=store, late_wait_s=float(late))


def example(master_address: str = "127.0.0.1:50051") -> str:
    """A complete extra config (the JSON ``--hicache-storage-backend-extra-config`` takes)."""
    from kvplane.integrations.sglang import CLASS_NAME, MODULE_PATH

    return (f'{{"backend_name": "kvplane", "module_path": "{MODULE_PATH}", "class_name": "{CLASS_NAME}", '
            f'"interface_v1": 1, "master_address": "{master_address}"}}')
