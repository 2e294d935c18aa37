"""The connector's configuration, parsed from vLLM's ``kv_transfer_config.kv_connector_extra_config``.

```json
{"offload": {"host_bytes": 8589934592, "store": {"master_address": "10.0.0.5:50051"}},
 "disagg": {"mode": "pull", "transport": "mooncake", "host": "10.0.0.7", "port": 5600},
 "device": "npu", "layouts": {"gqa": "split_kv"}}
```

``offload`` turns on the host tier (and Mooncake Store behind it); ``disagg`` turns on prefill/decode transfer,
the side following ``kv_role`` (producer: prefill, consumer: decode, both: both). Either or both may be given.
The disaggregation fields are ``DisaggConfig``'s; ``engine_id``, ``boot_id``, ``rank``, ``tp_size`` and ``dp_rank``
come from vLLM (``dp_rank`` is ``parallel_config.data_parallel_index``: vLLM resets ``data_parallel_rank`` to 0 in
every engine of a dense model, so it cannot tell DP ranks apart). ``disagg.host`` is the advertised address,
``disagg.bind_host`` the one the side channel binds; ``KVPLANE_SIDE_CHANNEL_HOST``, ``..._BIND_HOST``,
``..._PORT``, ``KVPLANE_MOONCAKE_PROTOCOL``, ``KVPLANE_MOONCAKE_DEVICE`` and ``KVPLANE_NIXL_BACKENDS`` override
them (``flows/disagg/wire/addresses.py``; a set variable wins over the key). Built in both the scheduler and every
worker from the same dict with ``kvplane.config.build`` (msgspec): a
bad value raises ``ConnectorConfigError`` (or ``OffloadConfigError``) naming its path (``$.offload.host_bytes``),
the value and the fix, before anything starts. Enumerated values are checked against what is there: ``device``
(or, without it, ``$KVPLANE_DEVICE``: the name the worker will select) against the installed backends' names,
without importing a device package, ``disagg.transport`` against the installed transports, ``layouts`` against
kvplane's layouts and KV families, ``disagg.mode``, ``disagg.protocol``, ``disagg.nixl_backends`` and
``offload.store.protocol`` against their choices.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvplane.backend.registry import ENV_VAR as DEVICE_ENV
from kvplane.backend.registry import default_registry as backends
from kvplane.config import build, check_keys
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.addresses import blame, env_overrides
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.flows.offload.config import OffloadConfig
from kvplane.kv.layouts import LAYOUTS
from kvplane.kv.spec import FAMILY_SLOTS

Role = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES: tuple[Role, ...] = ("kv_producer", "kv_consumer", "kv_both")
FROM_VLLM = ("engine_id", "boot_id", "rank", "tp_size", "dp_rank")
DEFAULT_PORT = 5600  # the scheduler must know it to put it into kv_transfer_params, so 0 (any) is refused
WHAT = "kv_connector_extra_config"


class ConnectorConfigError(KvplaneError, ValueError):
    """``kv_connector_extra_config`` (or ``kv_role``) holds a value the connector cannot use."""


@dataclass(frozen=True)
class ExtraConfig:
    """``kv_connector_extra_config`` as typed plain data; the sections are built by their own configs."""

    offload: dict[str, Any] | None = None
    disagg: dict[str, Any] | None = None
    device: str | None = None
    layouts: dict[str, str] | None = None
    lookup_timeout_s: float = 5.0
    cross_layer_blocks: bool = True


def data_parallel_index(parallel_config: Any) -> int:
    """The DP rank that tells engines apart: ``data_parallel_index`` (vLLM 0.27.1+), else ``data_parallel_rank``."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def _one_of(path: str, value: Any, choices: list[str], what: str) -> None:
    if value not in choices:
        raise ConnectorConfigError(f"{WHAT}: {path}={value!r} is not {what}; choose one of {sorted(choices)}")


def _check_device(configured: str | None, env: Mapping[str, str]) -> None:
    """The backend name a worker will select (``device.select_backend``: the key, else ``$KVPLANE_DEVICE``, else
    vLLM's platform), matched as the registry matches it (stripped, lowercased) against the registered names:
    entry points ``kvplane.backends``, none imported. Whether it can run here (its ``probe``) is left to the
    worker, since probing imports the device package."""
    if configured is not None:
        setting = f"{WHAT}: $.device={configured!r}"
        other = f"or remove the key (then ${DEVICE_ENV}, else vLLM's platform, picks)"
    elif env.get(DEVICE_ENV):
        configured, setting = env[DEVICE_ENV], f"${DEVICE_ENV}={env[DEVICE_ENV]!r}"
        other = f"or unset {DEVICE_ENV} (then vLLM's platform picks)"
    else:
        return
    names = backends().names()
    if configured.strip().lower() not in names:
        raise ConnectorConfigError(
            f"{setting} is not an installed backend; kvplane knows {names} (entry points 'kvplane.backends'): "
            f"choose one of them, install the backend's package (kvplane-cuda, kvplane-ascend, kvplane-mlu), {other}"
        )


@dataclass(frozen=True)
class ConnectorConfig:
    role: Role
    engine_id: str
    boot_id: str
    tp_size: int = 1
    offload: OffloadConfig | None = None
    disagg: DisaggConfig | None = None  # rank 0 of this DP rank, built and checked once; per rank in ``disagg_for``
    device: str | None = None
    layouts: Mapping[str, str] | None = None
    lookup_timeout_s: float = 5.0
    cross_layer_blocks: bool = True  # ask vLLM for one tensor of all layers where its layout allows (NHD)
    dp_rank: int = 0  # vLLM's data_parallel_index: DP ranks on one host listen on disjoint ports

    @property
    def is_prefill(self) -> bool:
        return self.disagg is not None and self.role in ("kv_producer", "kv_both")

    @property
    def is_decode(self) -> bool:
        return self.disagg is not None and self.role in ("kv_consumer", "kv_both")

    @property
    def mode(self) -> str:
        return self.disagg.mode if self.disagg is not None else "pull"

    @property
    def host(self) -> str:
        """The advertised side-channel address (the environment's override applied)."""
        return self.disagg.host if self.disagg is not None else "127.0.0.1"

    @property
    def port(self) -> int:
        """The instance's base side-channel port; DP rank d's starts at ``port + d*tp_size``."""
        return self.disagg.port if self.disagg is not None else DEFAULT_PORT

    def disagg_for(self, rank: int) -> DisaggConfig:
        """The ``DisaggConfig`` of TP rank ``rank`` of this DP rank (listening on ``port + dp_rank*tp_size +
        rank``); the environment's overrides are already in it."""
        if self.disagg is None:
            raise ConnectorConfigError(f"{WHAT}: no 'disagg' section, so TP rank {rank} has no DisaggConfig; add "
                                       f"'disagg': {{'mode': 'pull', 'port': ...}} to kv_connector_extra_config")
        return replace(self.disagg, rank=rank)

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, *, role: str | None, engine_id: str, instance_id: str = "",
        tp_size: int = 1, dp_rank: int = 0, env: Mapping[str, str] | None = None,
    ) -> ConnectorConfig:
        """Parse and check ``kv_connector_extra_config``; ``role`` is ``kv_transfer_config.kv_role``, ``dp_rank``
        ``data_parallel_index(parallel_config)``; ``env`` (default ``os.environ``) holds the overrides."""
        extra = dict(extra or {})
        check_keys(ExtraConfig, extra, f"{WHAT}: $", ConnectorConfigError)
        if role not in ROLES:
            raise ConnectorConfigError(f"kv_role={role!r} is not one of {ROLES}; set it in --kv-transfer-config")
        if "offload" not in extra and "disagg" not in extra:
            raise ConnectorConfigError(
                "kv_connector_extra_config has neither 'offload' nor 'disagg': the connector would do nothing; add "
                "'offload': {'host_bytes': ...} and/or 'disagg': {'mode': 'pull', 'port': ...}"
            )
        layouts = extra.get("layouts")
        if layouts is not None and not isinstance(layouts, Mapping):
            raise ConnectorConfigError(
                f"{WHAT}: $.layouts={layouts!r} must map a family to a layout, e.g. {{'gqa': 'split_kv'}}"
            )
        typed = build(ExtraConfig, extra, what=WHAT, error=ConnectorConfigError)
        env = os.environ if env is None else env
        _check_device(typed.device, env)
        for family, layout in (typed.layouts or {}).items():
            _one_of("$.layouts", family, list(FAMILY_SLOTS), "a KV family")
            _one_of(f"$.layouts.{family}", layout, list(LAYOUTS), "a layout")
        if not typed.lookup_timeout_s > 0:
            raise ConnectorConfigError(f"{WHAT}: $.lookup_timeout_s={typed.lookup_timeout_s} must be > 0")
        safe_id = engine_id.replace("/", "_")
        # one lifetime of the instance: vLLM draws instance_id per launch and hands the same config to every rank
        boot_id = hashlib.sha1(f"{safe_id}:{instance_id}".encode()).hexdigest()[:16]
        offload = None
        if typed.offload is not None:
            offload = OffloadConfig.from_dict(typed.offload, what=WHAT, path="$.offload")
        disagg = None
        if typed.disagg is not None:
            raw = {**typed.disagg, **env_overrides(env, ConnectorConfigError, WHAT)}
            clash = sorted(set(raw) & set(FROM_VLLM))
            if clash:
                raise ConnectorConfigError(
                    f"{WHAT}: $.disagg sets {clash}, which come from vLLM (engine_id from "
                    f"kv_transfer_config.engine_id, rank, tp_size and dp_rank from the parallel config); remove them"
                )
            if raw.get("port", DEFAULT_PORT) == 0:
                raise ConnectorConfigError(blame(
                    f"{WHAT}: $.disagg.port=0: the scheduler puts the port into kv_transfer_params before the "
                    f"workers bind it, so it must be fixed; pick a base port (TP rank r of DP rank d listens on "
                    f"port + d*tp_size + r)", env))
            vllm = {"engine_id": safe_id, "boot_id": boot_id, "rank": 0, "tp_size": tp_size, "dp_rank": dp_rank}
            try:  # every type and DisaggConfig check, now rather than in a worker
                disagg = DisaggConfig.from_dict({"port": DEFAULT_PORT, **raw, **vllm}, what=WHAT, path="$.disagg",
                                                env={})
            except DisaggConfigError as e:
                raise ConnectorConfigError(blame(str(e), env)) from e
        return cls(role, safe_id, boot_id, tp_size, offload, disagg, typed.device, typed.layouts,
                   typed.lookup_timeout_s, typed.cross_layer_blocks, dp_rank)
