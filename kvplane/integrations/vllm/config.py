"""The connector's configuration, parsed from vLLM's ``kv_transfer_config.kv_connector_extra_config``.

```json
{"offload": {"host_bytes": 8589934592, "store": {"master_address": "10.0.0.5:50051"}},
 "disagg": {"mode": "pull", "transport": "mooncake", "host": "10.0.0.7", "port": 5600},
 "device": "npu", "layouts": {"gqa": "split_kv"}}
```

``offload`` turns on the host tier (and Mooncake Store behind it); ``disagg`` turns on prefill/decode transfer,
the side following ``kv_role`` (producer: prefill, consumer: decode, both: both). Either or both may be given.
The disaggregation fields are ``DisaggConfig``'s; ``engine_id``, ``boot_id``, ``rank`` and ``tp_size`` come from
vLLM. Built in both the scheduler and every worker from the same dict; a bad value raises
``ConnectorConfigError`` naming the field, the value and the fix, before anything starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.config import DisaggConfig
from kvplane.flows.offload.config import OffloadConfig

Role = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES: tuple[Role, ...] = ("kv_producer", "kv_consumer", "kv_both")
KNOWN = ("offload", "disagg", "device", "layouts", "lookup_timeout_s", "cross_layer_blocks")
FROM_VLLM = ("engine_id", "boot_id", "rank", "tp_size")
DEFAULT_PORT = 5600  # the scheduler must know it to put it into kv_transfer_params, so 0 (any) is refused


class ConnectorConfigError(KvplaneError, ValueError):
    """``kv_connector_extra_config`` (or ``kv_role``) holds a value the connector cannot use."""


@dataclass(frozen=True)
class ConnectorConfig:
    role: Role
    engine_id: str
    boot_id: str
    tp_size: int = 1
    offload: OffloadConfig | None = None
    disagg: Mapping[str, Any] | None = None  # DisaggConfig fields less FROM_VLLM; per rank in ``disagg_for``
    device: str | None = None
    layouts: Mapping[str, str] | None = None
    lookup_timeout_s: float = 5.0
    cross_layer_blocks: bool = True  # ask vLLM for one tensor of all layers where its layout allows (NHD)

    @property
    def is_prefill(self) -> bool:
        return self.disagg is not None and self.role in ("kv_producer", "kv_both")

    @property
    def is_decode(self) -> bool:
        return self.disagg is not None and self.role in ("kv_consumer", "kv_both")

    @property
    def mode(self) -> str:
        return str((self.disagg or {}).get("mode", "pull"))

    @property
    def host(self) -> str:
        return str((self.disagg or {}).get("host", "127.0.0.1"))

    @property
    def port(self) -> int:
        return int((self.disagg or {}).get("port", DEFAULT_PORT))

    def disagg_for(self, rank: int) -> DisaggConfig:
        """The ``DisaggConfig`` of TP rank ``rank`` (the side channel listens on ``port + rank``)."""
        raw = {"port": DEFAULT_PORT, **(self.disagg or {})}
        return DisaggConfig.from_dict(
            {**raw, "engine_id": self.engine_id, "boot_id": self.boot_id, "rank": rank, "tp_size": self.tp_size}
        )

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, *, role: str | None, engine_id: str, instance_id: str = "",
        tp_size: int = 1,
    ) -> ConnectorConfig:
        """Parse and check ``kv_connector_extra_config``; ``role`` is ``kv_transfer_config.kv_role``."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KNOWN))
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; kvplane knows {list(KNOWN)}"
            )
        if role not in ROLES:
            raise ConnectorConfigError(f"kv_role={role!r} is not one of {ROLES}; set it in --kv-transfer-config")
        if "offload" not in extra and "disagg" not in extra:
            raise ConnectorConfigError(
                "kv_connector_extra_config has neither 'offload' nor 'disagg': the connector would do nothing; add "
                "'offload': {'host_bytes': ...} and/or 'disagg': {'mode': 'pull', 'port': ...}"
            )
        safe_id = engine_id.replace("/", "_")
        # one lifetime of the instance: vLLM draws instance_id per launch and hands the same config to every rank
        boot_id = hashlib.sha1(f"{safe_id}:{instance_id}".encode()).hexdigest()[:16]
        offload = None
        if extra.get("offload") is not None:
            raw = extra["offload"]
            if not isinstance(raw, Mapping):
                raise ConnectorConfigError(f"kv_connector_extra_config.offload={raw!r} must be an object")
            offload = OffloadConfig.from_dict(raw)
        disagg = None
        if extra.get("disagg") is not None:
            raw = extra["disagg"]
            if not isinstance(raw, Mapping):
                raise ConnectorConfigError(f"kv_connector_extra_config.disagg={raw!r} must be an object")
            clash = sorted(set(raw) & set(FROM_VLLM))
            if clash:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.disagg sets {clash}, which come from vLLM (engine_id from "
                    f"kv_transfer_config.engine_id, rank and tp_size from the parallel config); remove them"
                )
            if raw.get("port", DEFAULT_PORT) == 0:
                raise ConnectorConfigError(
                    "kv_connector_extra_config.disagg.port=0: the scheduler puts the port into kv_transfer_params "
                    "before the workers bind it, so it must be fixed; pick a base port (rank r listens on port + r)"
                )
            disagg = dict(raw)
        lookup_timeout_s = float(extra.get("lookup_timeout_s", 5.0))
        if not lookup_timeout_s > 0:
            raise ConnectorConfigError(f"kv_connector_extra_config.lookup_timeout_s={lookup_timeout_s} must be > 0")
        layouts = extra.get("layouts")
        if layouts is not None and not isinstance(layouts, Mapping):
            raise ConnectorConfigError(
                f"kv_connector_extra_config.layouts={layouts!r} must map a family to a layout, e.g. "
                f"{{'gqa': 'split_kv'}}"
            )
        cross_layer = extra.get("cross_layer_blocks", True)
        if not isinstance(cross_layer, bool):
            raise ConnectorConfigError(
                f"kv_connector_extra_config.cross_layer_blocks={cross_layer!r} must be true or false"
            )
        out = cls(role, safe_id, boot_id, tp_size, offload, disagg, extra.get("device"), layouts, lookup_timeout_s,
                  cross_layer)
        if disagg is not None:
            out.disagg_for(0)  # every DisaggConfig check, now rather than in a worker
        return out
