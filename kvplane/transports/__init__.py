"""Transports: transfer engines (Mooncake TE, NIXL) that move copy plans between ranks."""

from kvplane.transports.base import Op, PeerInfo, Transfer, Transport, TransportConfig

__all__ = ["Op", "PeerInfo", "Transfer", "Transport", "TransportConfig"]
