"""Configuration of the offload engine: the host tier's size in bytes and the optional Mooncake Store tier.

Both are frozen dataclasses checked on construction; a bad value raises ``OffloadConfigError`` naming the
field, the value and the fix. ``OffloadConfig.from_dict`` takes the JSON-ish dict an engine's config carries
(vLLM's ``kv_connector_extra_config``) and builds it with ``kvplane.config.build`` (msgspec): a wrong type, a
misspelt protocol or a missing ``master_address`` is an error naming its path (``$.store.protocol``), the value
and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvplane.config import build, invalid
from kvplane.flows.offload.errors import OffloadConfigError

MiB = 1 << 20
# Mooncake Store's protocols kvplane has run or documented (FACTS: tcp here, rdma for CUDA/MLU, ascend for NPUs)
StoreProtocol = Literal["tcp", "rdma", "ascend"]


def _positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise invalid(OffloadConfigError, owner, name, value, "must be > 0")


@dataclass(frozen=True)
class StoreConfig:
    """How to reach Mooncake Store (``mooncake_master`` + ``MooncakeDistributedStore``).

    ``segment_bytes`` is the memory this client contributes to the cluster-wide pool (objects of every instance
    may land in it); ``local_buffer_bytes`` is Mooncake's staging buffer. With ``write_through`` every block
    stored in the host tier is also put to the store as soon as its copy is done; otherwise blocks go to the
    store when the host tier evicts them. Every store call is bounded by ``timeout_s`` plus the time its bytes
    take at ``min_gbps``; a call past its bound, or an unhealthy client, turns the store off for
    ``retry_after_s`` with a warning, and requests carry on with the host tier alone. A monitor thread asks
    the client's health every ``health_interval_s``; calls read the last answer and never wait for one.
    """

    master_address: str
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: StoreProtocol = "tcp"
    device_name: str = ""
    segment_bytes: int = 256 * MiB
    local_buffer_bytes: int = 64 * MiB
    write_through: bool = False
    namespace: str = "kvplane"
    timeout_s: float = 2.0
    min_gbps: float = 0.5
    setup_timeout_s: float = 10.0
    retry_after_s: float = 10.0
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        host, _, port = self.master_address.rpartition(":")
        if not host or not port.isdigit():
            raise invalid(
                OffloadConfigError, "StoreConfig", "master_address", self.master_address,
                "is not host:port; pass e.g. '127.0.0.1:50051' (the address mooncake_master listens on)",
            )
        if self.protocol not in StoreProtocol.__args__:  # type: ignore[attr-defined]
            raise invalid(OffloadConfigError, "StoreConfig", "protocol", self.protocol,
                          f"is not one of {list(StoreProtocol.__args__)}")  # type: ignore[attr-defined]
        if self.segment_bytes < 0:
            raise invalid(OffloadConfigError, "StoreConfig", "segment_bytes", self.segment_bytes, "must be >= 0")
        _positive("StoreConfig", "local_buffer_bytes", self.local_buffer_bytes)
        for name in ("timeout_s", "min_gbps", "setup_timeout_s", "retry_after_s", "health_interval_s"):
            _positive("StoreConfig", name, getattr(self, name))
        if not self.namespace or "/" in self.namespace:
            raise invalid(OffloadConfigError, "StoreConfig", "namespace", self.namespace,
                          "must be non-empty and contain no '/'")


@dataclass(frozen=True)
class OffloadConfig:
    """The host tier holds at most ``host_bytes`` of KV (never more); ``store`` adds the cluster-wide tier."""

    host_bytes: int
    store: StoreConfig | None = None
    pinned: bool = True  # pin host memory where the device supports it (faster DMA)

    def __post_init__(self) -> None:
        if not isinstance(self.host_bytes, int) or self.host_bytes <= 0:
            raise invalid(
                OffloadConfigError, "OffloadConfig", "host_bytes", self.host_bytes,
                "must be a positive int (bytes of host memory for offloaded KV, e.g. 4 << 30)",
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, what: str = "offload config", path: str = "$") -> OffloadConfig:
        """Build from plain data: ``{"host_bytes": ..., "store": {"master_address": ..., ...}}``; ``what`` and
        ``path`` say where ``raw`` sits in a larger config, for the error messages."""
        return build(cls, raw, what=what, error=OffloadConfigError, path=path)
